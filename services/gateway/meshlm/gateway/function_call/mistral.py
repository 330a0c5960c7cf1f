"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` — the marker (a
special token, kept with skip_special_tokens=false, or plain text) then one JSON list of calls;
text before the marker is content. A list that does not parse into calls stays content."""

from __future__ import annotations

import json

from meshlm.gateway.function_call.base import Item, ToolCallParser, call_of, held_back
from meshlm.gateway.function_call.json_scan import value_end

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolCallParser):
    name = "mistral"

    def step(self, pending: str, final: bool) -> tuple[list[Item], int]:
        at = pending.find(MARKER)
        if at < 0:
            keep = len(pending) if final else held_back(pending, MARKER)
            return [pending[:keep]], keep
        if at > 0:
            return [pending[:at]], at
        body = len(MARKER)
        while body < len(pending) and pending[body].isspace():
            body += 1
        if body == len(pending):
            return ([pending], len(pending)) if final else ([], 0)
        if pending[body] not in "[{":
            return [pending[:body]], body  # a bare marker: it stays as text
        end = value_end(pending, body)
        if end is None:
            return ([pending], len(pending)) if final else ([], 0)
        try:
            value = json.loads(pending[body:end])
        except ValueError:
            return [pending[:end]], end
        calls = [call_of(v) for v in (value if isinstance(value, list) else [value])]
        if not calls or any(c is None for c in calls):
            return [pending[:end]], end
        return [c for c in calls if c is not None], end
