"""What a chat request asks of its outputs beyond text: tool calls and reasoning.

`plan_chat` reads tools / tool_choice / parallel_tool_calls, separate_reasoning and
chat_template_kwargs against the gateway's --tool-call-parser and --reasoning-parser:

- tool_choice none (the default without tools): no parsing (the tools still reach the template,
  as vLLM); auto (the default with tools): the configured format parser reads the output (a 400
  when none is configured); required / a named function: the output is constrained by a JSON
  schema built from the functions' parameters (function_call/constrained.py) and read as calls,
  so any model returns valid ones;
- reasoning is split when a parser is configured, separate_reasoning is true, the template was
  not told enable_thinking / thinking = false, and the output is not constrained to tool calls.

`ChoiceParts` then turns one choice's text deltas into reasoning, content and tool-call pieces;
the non-streamed message is the same pieces gathered, so both agree by construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from meshlm.gateway.config import GatewayConfig
from meshlm.gateway.errors import bad_request
from meshlm.gateway.function_call.constrained import named_schema, required_schema
from meshlm.gateway.function_call.registry import new_parser
from meshlm.gateway.function_call.stream import (
    CallDelta,
    CallStream,
    NamedCallStream,
    RequiredCallStream,
    ToolCallStream,
)
from meshlm.gateway.openai_protocol import ChatCompletionRequest, ChatMessageOut, DeltaMessage
from meshlm.gateway.openai_tool_types import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
)
from meshlm.gateway.reasoning.parser import ReasoningSplit, ReasoningStyle
from meshlm.gateway.reasoning.registry import style_of


@dataclass(frozen=True)
class ChatPlan:
    """How every choice of one request is read. Invariant: at most one of tool_parser, named,
    required is set, and a constraint (`tool_schema`) exactly when named or required is."""

    tool_parser: str | None = None
    named: str | None = None
    required: bool = False
    parallel: bool = True
    reasoning: ReasoningStyle | None = None
    tool_schema: str | None = None

    def new_choice(self) -> ChoiceParts:
        calls: CallStream | None = None
        if self.named is not None:
            calls = NamedCallStream(parallel=self.parallel, function=self.named)
        elif self.required:
            calls = RequiredCallStream(parallel=self.parallel)
        elif self.tool_parser is not None:
            calls = ToolCallStream(parallel=self.parallel, parser=new_parser(self.tool_parser))
        return ChoiceParts(ReasoningSplit(self.reasoning) if self.reasoning else None, calls)


def _thinking_off(kwargs: dict[str, Any] | None) -> bool:
    return any((kwargs or {}).get(key) is False for key in ("enable_thinking", "thinking"))


def plan_chat(body: ChatCompletionRequest, config: GatewayConfig) -> ChatPlan:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools (the functions to call)", "tool_choice")
    dumped = [t.model_dump(mode="json", exclude_none=True) for t in tools]
    reasoning = None
    if config.reasoning_parser and body.separate_reasoning and not _thinking_off(body.chat_template_kwargs):
        reasoning = style_of(config.reasoning_parser)
    if isinstance(choice, NamedToolChoice):
        match = [t for t in dumped if t["function"]["name"] == choice.function.name]
        if not match:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not one of tools", "tool_choice")
        schema = json.dumps(named_schema(match[0]))
        return ChatPlan(named=choice.function.name, parallel=body.parallel_tool_calls, tool_schema=schema)
    if choice == "required":
        schema = json.dumps(required_schema(dumped, body.parallel_tool_calls))
        return ChatPlan(required=True, parallel=body.parallel_tool_calls, tool_schema=schema)
    if choice == "auto":
        if config.tool_call_parser is None:
            raise bad_request(
                "tool_choice auto needs a tool-call parser: start the gateway with --tool-call-parser "
                "(or use tool_choice required or a named function, which need none)",
                "tool_choice",
            )
        return ChatPlan(tool_parser=config.tool_call_parser, parallel=body.parallel_tool_calls, reasoning=reasoning)
    return ChatPlan(reasoning=reasoning)


@dataclass
class ChoiceParts:
    """One choice: text deltas → (reasoning, content, call pieces); `message` when it is done."""

    reasoning: ReasoningSplit | None
    calls: CallStream | None
    reasoning_text: list[str] = field(default_factory=list)
    content_text: list[str] = field(default_factory=list)

    def _pieces(self, reasoning: str, content: str, final: bool) -> DeltaMessage | None:
        deltas: list[DeltaToolCall] = []
        if self.calls is not None:
            pieces = self.calls.feed(content) if content else []
            if final:
                pieces += self.calls.finish()
            content = "".join(p for p in pieces if isinstance(p, str))
            deltas = [_delta(p) for p in pieces if isinstance(p, CallDelta)]
        self.reasoning_text.append(reasoning)
        self.content_text.append(content)
        if not (reasoning or content or deltas):
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=deltas or None)

    def feed(self, text: str) -> DeltaMessage | None:
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
        else:
            reasoning, content = "", text
        return self._pieces(reasoning, content, final=False)

    def finish(self) -> DeltaMessage | None:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._pieces(reasoning, content, final=True)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls and self.calls.calls)

    def message(self) -> ChatMessageOut:
        """The whole message (after finish). Without parsers the content is the text as is; with
        them content and reasoning are stripped, None when empty (content "" when there is
        neither content nor a call, as OpenAI)."""
        content = "".join(self.content_text)
        if self.reasoning is not None or self.calls is not None:
            content = content.strip()  # what is left around the thinking and the calls
        reasoning = "".join(self.reasoning_text).strip()
        calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in (self.calls.calls if self.calls else [])
        ]
        return ChatMessageOut(
            content=content or (None if calls else ""),
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )


def _delta(piece: CallDelta) -> DeltaToolCall:
    if piece.id is not None:
        return DeltaToolCall(
            index=piece.index,
            id=piece.id,
            type="function",
            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
        )
    return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
