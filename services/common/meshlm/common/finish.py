"""FinishReason: why a request ended, one type from the scheduler loop to the client.

    STOP    a stop token (`matched` is its id) or stop string (`matched` is the string) matched
    LENGTH  max_new_tokens or the context was reached (`length`: output tokens)
    ABORT   the request failed or was cancelled (`message`, HTTP-style `status_code`)

A running request has no FinishReason (None). This module is the one place that decides

  * the wire form: `to_proto` / `from_proto` (meshlm.v1.FinishReason; unset = not finished),
  * SGLang's finish_reason dict: `to_json`,
  * what an ABORT becomes as an error: `grpc_code` (tokenizer) and `http_status` (gateway), and
    the statuses the services abort with (`AbortStatus`).

Torch-free: every service imports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import grpc

from meshlm.common.errors import grpc_code_for_http
from meshlm.v1 import common_pb2


class FinishKind(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class AbortStatus(enum.IntEnum):
    """The HTTP-style status of an ABORT (meshlm.common.errors maps it to a gRPC code)."""

    BAD_REQUEST = 400  # bad input
    NOT_FOUND = 404  # unknown session
    CANCELLED = 499  # aborted on request (client gone, abort API, tokenizer went away)
    INTERNAL = 500  # the service failed the request (crash, lost decode state, KV too small)
    UNAVAILABLE = 503  # overload, draining, a component unreachable


_KIND_TO_PROTO = {
    FinishKind.STOP: common_pb2.FINISH_TYPE_STOP,
    FinishKind.LENGTH: common_pb2.FINISH_TYPE_LENGTH,
    FinishKind.ABORT: common_pb2.FINISH_TYPE_ABORT,
}
_PROTO_TO_KIND = {v: k for k, v in _KIND_TO_PROTO.items()}


@dataclass(frozen=True)
class FinishReason:
    """A value. Invariants: `matched` only for STOP; `length` only for LENGTH; `message` and
    `status_code` only for ABORT (build it with the constructors below)."""

    kind: FinishKind
    matched: int | str | None = None
    length: int = 0
    message: str = ""
    status_code: int = 0

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def stopped(cls, matched: int | str | None = None) -> FinishReason:
        return cls(FinishKind.STOP, matched=matched)

    @classmethod
    def at_length(cls, length: int) -> FinishReason:
        return cls(FinishKind.LENGTH, length=length)

    @classmethod
    def aborted(cls, message: str, status_code: int = AbortStatus.BAD_REQUEST) -> FinishReason:
        return cls(FinishKind.ABORT, message=message, status_code=int(status_code))

    # ---- reading ------------------------------------------------------------------------
    @property
    def is_abort(self) -> bool:
        return self.kind is FinishKind.ABORT

    @property
    def is_cancelled(self) -> bool:
        """Aborted on request (499): SGLang's native API still returns the output so far."""
        return self.is_abort and self.status_code == AbortStatus.CANCELLED

    @property
    def matched_token(self) -> int | None:
        """The stop token id that ended the request, if a token did."""
        m = self.matched
        return m if isinstance(m, int) and not isinstance(m, bool) else None

    @property
    def matched_str(self) -> str | None:
        """The stop string that ended the request, if a string did."""
        return self.matched if isinstance(self.matched, str) else None

    # ---- the error of an ABORT ----------------------------------------------------------
    @property
    def grpc_code(self) -> grpc.StatusCode:
        """The gRPC status a tokenizer fails the request with (status 0: aborted on request)."""
        if self.status_code == 0:
            return grpc.StatusCode.CANCELLED
        return grpc_code_for_http(self.status_code)

    @property
    def http_status(self) -> int:
        """The HTTP status a gateway answers with (a status below 400 reads as 500)."""
        return self.status_code if self.status_code >= 400 else AbortStatus.INTERNAL.value

    # ---- other forms --------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """SGLang's finish_reason dict."""
        if self.kind is FinishKind.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.kind is FinishKind.LENGTH:
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message, "status_code": self.status_code or None}

    def to_proto(self) -> common_pb2.FinishReason:
        pb = common_pb2.FinishReason(type=_KIND_TO_PROTO[self.kind])
        if self.matched_token is not None:
            pb.matched_token = self.matched_token
        elif self.matched_str is not None:
            pb.matched_str = self.matched_str
        if self.kind is FinishKind.LENGTH:
            pb.length = self.length
        elif self.kind is FinishKind.ABORT:
            pb.message = self.message
            pb.status_code = self.status_code
        return pb

    @classmethod
    def from_proto(cls, pb: common_pb2.FinishReason) -> FinishReason | None:
        """None for an unset field (type UNSPECIFIED: not finished)."""
        kind = _PROTO_TO_KIND.get(pb.type)
        if kind is None:
            return None
        if kind is FinishKind.STOP:
            which = pb.WhichOneof("matched")
            return cls.stopped(getattr(pb, which) if which else None)
        if kind is FinishKind.LENGTH:
            return cls.at_length(pb.length)
        return cls(FinishKind.ABORT, message=pb.message, status_code=pb.status_code)
