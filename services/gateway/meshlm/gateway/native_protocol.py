"""Request bodies of the SGLang-native routes (SGLang's GenerateReqInput, SamplingParams, ...) as
pydantic models: strict types; unknown sampling keys are rejected, other unknown keys ignored.
Numbers and lists are bounded by meshlm.gateway.input_types (meshlm.common.input_limits and the
sampling rules of meshlm.common.sampling_rules), the bounds the tokenizer applies to the same call."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from meshlm.common.input_limits import INT32_MAX, MAX_PROMPTS, MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS_NUM
from meshlm.common.sampling_rules import RANGES
from meshlm.gateway.input_types import (
    IdText,
    Int32,
    NativeLogitBias,
    PromptText,
    PromptTexts,
    RequestId,
    Stop,
    StopTokenIds,
    TokenId,
    TokenIdBatch,
    TokenIds,
    check_token_keys,
    ruled,
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class NativeSamplingParams(BaseModel):
    """SGLang's SamplingParams as a JSON object; unknown keys are rejected."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    max_new_tokens: int | None = ruled(None, "max_new_tokens")
    min_new_tokens: int | None = ruled(None, "min_new_tokens")
    temperature: float | None = ruled(None, "temperature")
    top_p: float | None = ruled(None, "top_p")
    top_k: int | None = ruled(None, "top_k", "-1 = whole vocabulary")
    min_p: float | None = ruled(None, "min_p")
    frequency_penalty: float | None = ruled(None, "frequency_penalty")
    presence_penalty: float | None = ruled(None, "presence_penalty")
    repetition_penalty: float | None = ruled(None, "repetition_penalty")
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = ruled(None, "n")
    logit_bias: NativeLogitBias | None = None
    sampling_seed: int | None = ruled(None, "sampling_seed")
    stream_interval: int | None = ruled(None, "stream_interval")
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and not RANGES["top_k"].allows(v):
            raise ValueError(f"must be {RANGES['top_k'].describe()}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_token_keys(v)


class SessionParams(_Strict):
    id: RequestId
    rid: IdText | None = None


class GenerateReqInput(_Strict):
    text: PromptText | PromptTexts | None = None
    input_ids: TokenIds | TokenIdBatch | None = None
    sampling_params: (
        NativeSamplingParams | Annotated[list[NativeSamplingParams], Field(max_length=MAX_PROMPTS)] | None
    ) = None
    rid: RequestId | Annotated[list[RequestId], Field(max_length=MAX_PROMPTS)] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 = output tokens only")
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS_NUM, description="also at most the vocabulary size")
    token_ids_logprob: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: SessionParams | None = None
    input_embeds: Any | None = None
    image_data: Any | None = None
    lora_path: Any | None = None


class EmbeddingReqInput(_Strict):
    text: PromptText | PromptTexts | None = None
    input_ids: TokenIds | TokenIdBatch | None = None
    rid: RequestId | None = None


class AbortReq(_Strict):
    rid: IdText = ""
    abort_all: bool = False


class OpenSessionReq(_Strict):
    capacity_of_str_len: Int32 = 0
    session_id: IdText | None = None


class CloseSessionReq(_Strict):
    session_id: RequestId
