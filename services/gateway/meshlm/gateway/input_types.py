"""Constrained field types of the REST bodies, built from meshlm.common.input_limits and
meshlm.common.sampling_rules: the one place where a limit becomes a pydantic constraint (and so a
min/max/length in the OpenAPI document).

Invariant: a value that passes these types fits its protobuf field (int32 token ids, int64 seeds,
finite float32s) and the size limits the tokenizer applies to the same gRPC message, so building
the message never raises and the tokenizer's limit checks only reject what REST cannot know
(the vocabulary size, the context length).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from meshlm.common.input_limits import (
    FLOAT32_MAX,
    INT32_MAX,
    MAX_ID_CHARS,
    MAX_LOGIT_BIAS,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from meshlm.common.sampling_rules import RANGES

TOKEN_ID_DESCRIPTION = "a token id of the model's vocabulary"  # openapi_doc.py finds token ids by it
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, description=TOKEN_ID_DESCRIPTION)]
TokenIdList = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]  # may be empty
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]  # one prompt
TokenIdBatch = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
PromptText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
PromptTexts = Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
# One prompt or a batch: text, texts, token ids, lists of token ids.
PromptValue = PromptText | PromptTexts | TokenIds | TokenIdBatch
MessageText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
IdText = Annotated[str, Field(max_length=MAX_ID_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Float32 = Annotated[float, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
TOKEN_KEY_PATTERN = r"^[0-9]{1,10}$"  # a token id as a JSON object key; <= INT32_MAX is checked after
TokenKey = Annotated[str, Field(pattern=TOKEN_KEY_PATTERN)]
_BIAS_MAP = Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})
OPENAI_MAX_LOGIT_BIAS = 100  # OpenAI's bias range is [-100, 100]
# logit_bias: {token id as a string: bias}, at most MAX_LOGIT_BIAS entries; OpenAI's range, or any float32.
OpenAILogitBias = Annotated[
    dict[TokenKey, Annotated[float, Field(ge=-OPENAI_MAX_LOGIT_BIAS, le=OPENAI_MAX_LOGIT_BIAS)]], _BIAS_MAP
]
NativeLogitBias = Annotated[dict[TokenKey, Float32], _BIAS_MAP]


def check_token_keys(bias: dict[str, float] | None) -> dict[str, float] | None:
    """Every key (already all digits) is a token id within int32."""
    for key in bias or {}:
        if int(key) > INT32_MAX:
            raise ValueError(f"key {key} is not a token id (at most {INT32_MAX})")
    return bias


def ruled(default: Any, rule: str, description: str | None = None, **narrower: float) -> Any:
    """A Field bounded as meshlm.common.sampling_rules.RANGES[rule] (narrowed by `narrower`);
    a real field without an upper bound gets float32's, so that it stays finite on the wire."""
    bounds: dict[str, Any] = {**RANGES[rule].bounds(**narrower)}
    if not RANGES[rule].integer and "le" not in bounds and "lt" not in bounds:
        bounds["le"] = FLOAT32_MAX
    extra = RANGES[rule].extra
    schema_extra: dict[str, Any] | None = None
    if extra is not None:  # top_k's -1 below the range: document [-1, high] without the gap between
        low = bounds.pop("ge", None)
        bounds.pop("gt", None)
        bounds["ge"] = extra
        if low is not None and low > extra + 1:
            schema_extra = {"not": {"enum": list(range(extra + 1, int(low)))}}
    return Field(default, description=description, json_schema_extra=schema_extra, **bounds)


__all__ = [
    "Float32",
    "Int32",
    "MessageText",
    "Name",
    "PromptText",
    "PromptTexts",
    "PromptValue",
    "RequestId",
    "IdText",
    "Stop",
    "StopString",
    "StopTokenIds",
    "TokenId",
    "TokenIdBatch",
    "TokenIdList",
    "TokenIds",
    "check_token_keys",
    "NativeLogitBias",
    "OpenAILogitBias",
    "ruled",
]
