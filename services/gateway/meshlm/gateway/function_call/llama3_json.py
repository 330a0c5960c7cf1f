"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` objects ("arguments" also
taken), optionally after `<|python_tag|>`, several separated by `;`. Text before the first
object is content; an object that is not a call stays content."""

from __future__ import annotations

import json
import re

from meshlm.gateway.function_call.base import Item, ToolCallParser, call_of, held_back, held_back_pattern
from meshlm.gateway.function_call.json_scan import value_end

PYTHON_TAG = "<|python_tag|>"
# A call object opens with {"name": (whitespace allowed); every prefix of that, for hold-back.
_START = re.compile(r'\{\s*"name"\s*:')
_START_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')
_SEPARATOR = re.compile(r"[\s;]+")


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self._after_call = False  # separators right after a call are dropped

    def step(self, pending: str, final: bool) -> tuple[list[Item], int]:
        if self._after_call:
            sep = _SEPARATOR.match(pending)
            if sep:
                return [], sep.end()
            self._after_call = False
        if pending.startswith(PYTHON_TAG):
            return [], len(PYTHON_TAG)
        found = _START.search(pending)
        tag = pending.find(PYTHON_TAG)
        at = min(x for x in (found.start() if found else -1, tag) if x >= 0) if (found or tag >= 0) else -1
        if at < 0:
            keep = len(pending)
            if not final:
                keep = min(held_back_pattern(pending, _START_PREFIX), held_back(pending, PYTHON_TAG))
            return [pending[:keep]], keep
        if at > 0:
            return [pending[:at]], at
        end = value_end(pending, 0)
        if end is None:
            return ([pending], len(pending)) if final else ([], 0)
        try:
            call = call_of(json.loads(pending[:end]))
        except ValueError:
            call = None
        if call is None:
            return [pending[:end]], end
        self._after_call = True
        return [call], end
