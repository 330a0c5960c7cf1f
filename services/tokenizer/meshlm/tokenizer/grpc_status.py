"""The gRPC status a TokenizerService method ends with for an exception: one rule for the unary
methods, Generate and each stream of GenerateStream."""

from __future__ import annotations

import logging

import grpc

from meshlm.common.errors import ServiceError
from meshlm.common.input_limits import InvalidArgument

logger = logging.getLogger(__name__)


def status_of(e: Exception, where: str) -> tuple[grpc.StatusCode, str]:
    """ServiceError: its code and message; InvalidArgument (a rule of common.input_limits):
    INVALID_ARGUMENT; anything else: INTERNAL naming the exception, logged with its traceback
    (call it from the `except` block)."""
    if isinstance(e, ServiceError):
        return e.code, e.message
    if isinstance(e, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    logger.exception("internal error in %s", where)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
