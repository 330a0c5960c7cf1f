"""OpenAI-compatible request and response models (field names and defaults as OpenAI's API, plus
SGLang's extras). Requests validate strictly: wrong JSON types and out-of-range values are 400s
(the error handler in errors.py), never coerced and never 422. Every number and list is bounded by
meshlm.gateway.input_types (the limits of meshlm.common.input_limits and the sampling rules of
meshlm.common.sampling_rules, which the tokenizer and scheduler apply too), narrowed where OpenAI's
API is narrower (temperature, logit_bias, top_logprobs); the OpenAPI document states each bound."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from meshlm.common.input_limits import INT32_MAX, MAX_MESSAGES, MAX_N, MAX_TOP_LOGPROBS
from meshlm.common.sampling_rules import RANGES
from meshlm.gateway.input_types import (
    IdText,
    MessageText,
    Name,
    OpenAILogitBias,
    PromptText,
    PromptValue,
    RequestId,
    Stop,
    StopTokenIds,
    TokenIdList,
    check_token_keys,
    ruled,
)
from meshlm.gateway.openai_tool_types import DeltaToolCall, Tool, ToolCallIn, ToolCallOut, ToolChoice

# ---------------------------------------------------------------------------- requests

OPENAI_MAX_TEMPERATURE = 2  # OpenAI's limit; the servers take any finite temperature >= 0


class _Request(BaseModel):
    # strict: "16" is not an int and "true" is not a bool; no NaN / inf. Unknown fields are kept in
    # model_extra so that each request's unsupported fields are logged or, with --strict-api,
    # rejected (openai_fields.py): never dropped without a word.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Sampling fields shared by completions and chat (OpenAI's, then SGLang's extras)."""

    model: Name | None = Field(None, description="must be the served model name (GET /v1/models)")
    n: int = ruled(1, "n")
    stop: Stop | None = None
    seed: int | None = ruled(None, "sampling_seed")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = ruled(None, "temperature", "default 1.0", le=OPENAI_MAX_TEMPERATURE)
    top_p: float | None = ruled(None, "top_p", "default 1.0")
    presence_penalty: float | None = ruled(None, "presence_penalty")
    frequency_penalty: float | None = ruled(None, "frequency_penalty")
    logit_bias: OpenAILogitBias | None = None
    user: Name | None = None
    # SGLang extras
    top_k: int | None = ruled(None, "top_k", "-1 = whole vocabulary")
    min_p: float | None = ruled(None, "min_p")
    min_tokens: int | None = ruled(None, "min_new_tokens")
    repetition_penalty: float | None = ruled(None, "repetition_penalty")
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: RequestId | None = None
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
        return check_token_keys(v)


class CompletionRequest(_SamplingFields):
    prompt: PromptValue
    max_tokens: int | None = ruled(16, "max_new_tokens")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="number of top logprobs per token")
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Name
    text: MessageText | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: MessageText | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: IdText | None = None  # tool: the call this message answers
    reasoning_content: MessageText | None = None  # assistant: its earlier thinking (templates may render it)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = ruled(None, "max_new_tokens", "deprecated; max_completion_tokens wins")
    max_completion_tokens: int | None = ruled(None, "max_new_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
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
    model: Name | None = None
    input: PromptValue
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: Name | None = None
    rid: RequestId | None = None


class TokenizeRequest(_Request):
    """Text (`prompt`) or a chat (`messages`, or `prompt` as a list of messages) rendered as
    /v1/chat/completions renders it (vLLM's tokenize request)."""

    model: Name | None = None
    prompt: PromptText | Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class DetokenizeRequest(_Request):
    model: Name | None = None
    tokens: TokenIdList
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
