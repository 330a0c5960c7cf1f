"""OpenAI-compatible request and response models (field names and defaults as OpenAI's API, plus
SGLang's extras). Requests validate strictly: wrong JSON types and out-of-range values are 400s
(the error handler in errors.py), never coerced and never 422. The bounds of the sampling fields
are meshlm.common.sampling_rules' (the ones the tokenizer and scheduler apply), narrowed where
OpenAI's API is narrower (n, temperature)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from meshlm.common.sampling_rules import RANGES
from meshlm.gateway.openai_tool_types import DeltaToolCall, Tool, ToolCallIn, ToolCallOut, ToolChoice

# ---------------------------------------------------------------------------- requests

INT32 = 1 << 31
OPENAI_MAX_N = 128
OPENAI_MAX_TEMPERATURE = 2  # OpenAI's limit; the servers take any finite temperature >= 0


def _ruled(default: Any, rule: str, description: str | None = None, **narrower: float) -> Any:
    """A Field bounded as meshlm.common.sampling_rules.RANGES[rule], narrowed by `narrower`."""
    return Field(default, description=description, **RANGES[rule].bounds(**narrower))


class _Request(BaseModel):
    # strict: "16" is not an int and "true" is not a bool. Unknown fields are kept in model_extra
    # so that each request's unsupported fields are logged or, with --strict-api, rejected
    # (openai_fields.py): never dropped without a word.
    model_config = ConfigDict(strict=True, extra="allow")


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

    model: str | None = Field(None, description="must be the served model name (GET /v1/models)")
    n: int = _ruled(1, "n", le=OPENAI_MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = _ruled(None, "temperature", "default 1.0", le=OPENAI_MAX_TEMPERATURE)
    top_p: float | None = _ruled(None, "top_p", "default 1.0")
    presence_penalty: float | None = _ruled(None, "presence_penalty")
    frequency_penalty: float | None = _ruled(None, "frequency_penalty")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = Field(None, lt=INT32, description="-1 = whole vocabulary")
    min_p: float | None = _ruled(None, "min_p")
    min_tokens: int | None = _ruled(None, "min_new_tokens", lt=INT32)
    repetition_penalty: float | None = _ruled(None, "repetition_penalty")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and not RANGES["top_k"].allows(v):
            raise ValueError(f"must be {RANGES['top_k'].describe()}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("rid")
    @classmethod
    def _rid(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("must not be empty")
        return v


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = _ruled(16, "max_new_tokens", lt=INT32)
    logprobs: int | None = Field(None, ge=0, le=20, description="number of top logprobs per token")
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return check_prompt(v)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its earlier thinking (templates may render it)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = _ruled(None, "max_new_tokens", "deprecated; max_completion_tokens wins", lt=INT32)
    max_completion_tokens: int | None = _ruled(None, "max_new_tokens", lt=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    continue_final_message: bool = Field(False, description="leave the final assistant message open (transformers')")
    add_generation_prompt: bool | None = Field(None, description="default: not continue_final_message")
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, else none")
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="passed to the chat template as the variable reasoning_effort"
    )
    separate_reasoning: bool = Field(True, description="split thinking into reasoning_content (--reasoning-parser)")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    rid: str | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_prompt(v)


class TokenizeRequest(_Request):
    """Text (`prompt`) or a chat (`messages`, or `prompt` as a list of messages) rendered as
    /v1/chat/completions renders it (vLLM's tokenize request)."""

    model: str | None = None
    prompt: str | list[ChatMessage] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool | None = None


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
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_extras(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


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
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    text: str
