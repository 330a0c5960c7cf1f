"""The limits of every public input, written once: the numbers, and the checks that name a field.

Torch- and protobuf-free. The gateway's pydantic models take their Field(ge=, le=, max_length=)
constraints from these constants (so the OpenAPI document states them), the tokenizer checks the
public gRPC messages against the same constants (meshlm.tokenizer.request), and the sampling-
parameter rules (meshlm.common.sampling_rules) bound their integers and lists with them.

Two kinds of limit:
* wire ranges: a proto `int32` / `int64` / `float` field holds only so much (INT32_MAX, ...); a REST
  value outside them would make protobuf raise, so the gateway rejects it first;
* sizes: how many prompts, samples, stop strings, ... one request may carry, and how long a
  string may be, so that no single request can take the process's memory or its event loop.

Every violation raises `InvalidArgument` (a ValueError: INVALID_ARGUMENT / HTTP 400) whose
message names the field, the limit and what was given.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Final

__all__ = [
    "FLOAT32_MAX",
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_ID_CHARS",
    "MAX_LOGIT_BIAS",
    "MAX_MESSAGES",
    "MAX_N",
    "MAX_NAME_CHARS",
    "MAX_PROMPTS",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKENS",
    "MAX_REQUEST_BYTES",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKEN_IDS_LOGPROB",
    "MAX_TOP_LOGPROBS",
    "MAX_TOP_LOGPROBS_NUM",
    "InvalidArgument",
    "check_at_most",
    "check_chars",
    "check_count",
    "check_int_range",
]

# ---- wire ranges (protobuf scalar types)
INT32_MIN: Final = -(1 << 31)
INT32_MAX: Final = (1 << 31) - 1
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
FLOAT32_MAX: Final = 3.4028234663852886e38  # the largest finite float32; larger becomes inf

# ---- sizes of one request
MAX_PROMPTS: Final = 1024  # prompts of one request (a batch)
MAX_N: Final = 128  # samples per prompt (OpenAI's limit of n)
MAX_PROMPT_CHARS: Final = 1 << 22  # characters of one text prompt or chat message content
MAX_PROMPT_TOKENS: Final = 1 << 20  # token ids of one prompt (the context length limits further)
MAX_MESSAGES: Final = 4096  # messages of one chat
MAX_STOP: Final = 64  # stop strings
MAX_STOP_CHARS: Final = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS: Final = 1024
MAX_LOGIT_BIAS: Final = 1024  # logit_bias entries
MAX_TOP_LOGPROBS: Final = 20  # OpenAI's top_logprobs / logprobs
MAX_TOP_LOGPROBS_NUM: Final = 1024  # SGLang's top_logprobs_num (also at most the vocabulary)
MAX_TOKEN_IDS_LOGPROB: Final = 1024
MAX_ID_CHARS: Final = 256  # a request id, session id or session rid
MAX_NAME_CHARS: Final = 1024  # a model name, a user, a chat role or message name
MAX_REQUEST_BYTES: Final = 32 << 20  # the gateway's default --max-request-bytes (HTTP body)


class InvalidArgument(ValueError):
    """A value outside its rule (a limit, a sampling parameter, a token id): INVALID_ARGUMENT /
    HTTP 400. The message names the field."""


def check_count(field: str, items: Sized, limit: int) -> None:
    """At most `limit` items in `field` (a list, a map)."""
    if len(items) > limit:
        raise InvalidArgument(f"{field} has {len(items)} entries; at most {limit} are allowed")


def check_chars(field: str, text: str, limit: int) -> None:
    """At most `limit` characters in the string `field`."""
    if len(text) > limit:
        raise InvalidArgument(f"{field} has {len(text)} characters; at most {limit} are allowed")


def check_at_most(field: str, value: int, limit: int, why: str = "") -> None:
    """value <= limit; `why` says where the limit comes from (e.g. "the vocabulary size")."""
    if value > limit:
        raise InvalidArgument(f"{field} must be <= {why + ' ' if why else ''}{limit}, got {value}")


def check_int_range(field: str, value: int, low: int, high: int) -> None:
    """low <= value <= high (an integer field's range, e.g. a proto int32's)."""
    if not low <= value <= high:
        raise InvalidArgument(f"{field} must be in [{low}, {high}], got {value}")
