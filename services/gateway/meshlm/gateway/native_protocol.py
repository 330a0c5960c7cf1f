"""Request bodies of the SGLang-native routes (SGLang's GenerateReqInput, SamplingParams, ...) as
pydantic models: strict types; unknown sampling keys are rejected, other unknown keys ignored."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class NativeSamplingParams(BaseModel):
    """SGLang's SamplingParams as a JSON object; unknown keys are rejected."""

    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: int | None = Field(None, ge=0, lt=1 << 31)
    min_new_tokens: int | None = Field(None, ge=0, lt=1 << 31)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=1 << 31)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = Field(None, ge=1, le=128)
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stream_interval: int | None = Field(None, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (whole vocabulary) or >= 1")
        return v


class SessionParams(_Strict):
    id: str
    rid: str | None = None


class GenerateReqInput(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = Field(None, ge=-1, description="-1 = output tokens only")
    top_logprobs_num: int = Field(0, ge=0)
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: SessionParams | None = None
    input_embeds: Any | None = None
    image_data: Any | None = None
    lora_path: Any | None = None


class EmbeddingReqInput(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | None = None


class AbortReq(_Strict):
    rid: str = ""
    abort_all: bool = False


class OpenSessionReq(_Strict):
    capacity_of_str_len: int = Field(default=0, ge=0)
    session_id: str | None = None


class CloseSessionReq(_Strict):
    session_id: str
