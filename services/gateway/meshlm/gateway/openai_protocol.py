"""OpenAI-compatible request and response models (field names and defaults as OpenAI's API, plus
SGLang's extras). Requests validate strictly: wrong JSON types and out-of-range values are 400s
(the error handler in errors.py), never coerced and never 422. The bounds of the sampling fields
are meshlm.common.sampling_rules' (the ones the tokenizer and scheduler apply), narrowed where
OpenAI's API is narrower (n, temperature)."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from meshlm.common.sampling_rules import RANGES

# ---------------------------------------------------------------------------- requests

INT32 = 1 << 31
OPENAI_MAX_N = 128
OPENAI_MAX_TEMPERATURE = 2  # OpenAI's limit; the servers take any finite temperature >= 0


def _ruled(default: Any, rule: str, description: Optional[str] = None, **narrower: float) -> Any:
    """A Field bounded as meshlm.common.sampling_rules.RANGES[rule], narrowed by `narrower`."""
    return Field(default, description=description, **RANGES[rule].bounds(**narrower))


class _Request(BaseModel):
    # strict: "16" is not an int and "true" is not a bool; unknown fields are ignored (as SGLang).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def check_prompt(v: Any) -> Any:
    """A prompt (str | list[str] | list[int] | list[list[int]]) must not be empty, nor any of its items."""
    if not v:
        raise ValueError("must not be empty")
    if isinstance(v, list) and isinstance(v[0], (str, list)) and any(not p for p in v):
        raise ValueError("must not contain an empty prompt")
    return v


class _SamplingFields(_Request):
    """Sampling fields shared by completions and chat (OpenAI's, then SGLang's extras)."""

    model: Optional[str] = Field(None, description="must be the served model name (GET /v1/models)")
    n: int = _ruled(1, "n", le=OPENAI_MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = _ruled(
        None, "temperature", "default 1.0", le=OPENAI_MAX_TEMPERATURE
    )
    top_p: Optional[float] = _ruled(None, "top_p", "default 1.0")
    presence_penalty: Optional[float] = _ruled(None, "presence_penalty")
    frequency_penalty: Optional[float] = _ruled(None, "frequency_penalty")
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # SGLang extras
    top_k: Optional[int] = Field(None, lt=INT32, description="-1 = whole vocabulary")
    min_p: Optional[float] = _ruled(None, "min_p")
    min_tokens: Optional[int] = _ruled(None, "min_new_tokens", lt=INT32)
    repetition_penalty: Optional[float] = _ruled(None, "repetition_penalty")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    rid: Optional[str] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and not RANGES["top_k"].allows(v):
            raise ValueError(f"must be {RANGES['top_k'].describe()}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("rid")
    @classmethod
    def _rid(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v:
            raise ValueError("must not be empty")
        return v


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = _ruled(16, "max_new_tokens", lt=INT32)
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="number of top logprobs per token")
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return check_prompt(v)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = _ruled(
        None, "max_new_tokens", "deprecated; max_completion_tokens wins", lt=INT32
    )
    max_completion_tokens: Optional[int] = _ruled(None, "max_new_tokens", lt=INT32)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    continue_final_message: bool = False
    tool_choice: Optional[Any] = None

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Request):
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    rid: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_prompt(v)


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Union[str, list[ChatMessage]]
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]
    skip_special_tokens: Optional[bool] = None


# ---------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    matched_stop: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None
    refusal: Optional[list[ChatLogprobToken]] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meshlm"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    text: str
