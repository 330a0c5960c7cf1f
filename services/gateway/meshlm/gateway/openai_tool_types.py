"""OpenAI's tool-calling shapes: the tools a request offers, its tool_choice, the calls of an
assistant message in the history, and the calls of a response message and of a stream delta.
Request models are strict and keep unknown fields (extra="allow") so that the gateway can report
them (openai_fields.py); response models leave out what is unset where OpenAI does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _In(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class FunctionDefinition(_In):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="a-z, A-Z, 0-9, _, ., - (at most 64)")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_In):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_In):
    name: str
    arguments: str = Field(..., description="JSON text, as the model returned it")


class ToolCallIn(_In):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


# ---------------------------------------------------------------------------- responses


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One call's piece in a chunk: the first has id, type and name (arguments ""), the next
    ones argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}
