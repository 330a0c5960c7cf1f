"""Hermes / Qwen2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
any number, with text around them (NousResearch Hermes 2/3, Qwen2.5, Qwen3).

A block whose body is not one JSON call stays in the content as written. A block the model
never closed is a call if its body parses at the end of the text, else content."""

from __future__ import annotations

import json

from meshlm.gateway.function_call.base import Item, ToolCall, ToolCallParser, call_of, held_back

START = "<tool_call>"
END = "</tool_call>"


def _call(body: str) -> ToolCall | None:
    try:
        return call_of(json.loads(body))
    except ValueError:
        return None


class HermesParser(ToolCallParser):
    name = "hermes"

    def step(self, pending: str, final: bool) -> tuple[list[Item], int]:
        at = pending.find(START)
        if at < 0:
            keep = len(pending) if final else held_back(pending, START)
            return [pending[:keep]], keep
        if at > 0:
            return [pending[:at]], at
        close = pending.find(END, len(START))
        if close < 0:
            if not final:
                return [], 0
            call = _call(pending[len(START) :])
            return [call if call else pending], len(pending)
        end = close + len(END)
        call = _call(pending[len(START) : close])
        return [call if call else pending[:end]], end


class Qwen25Parser(HermesParser):
    """Qwen2.5's format is Hermes' (its template asks for exactly these tags)."""

    name = "qwen25"
