"""What every tool-call parser is: a function from the model's text to content and calls,
decided on complete units so that streaming and not give the same result.

`ToolCallParser.step(pending, final)` looks at the text not consumed yet and returns the items
it can decide (content text, or a `ToolCall`) and how many characters they consumed. Invariant
(prefix consistency): what it decides on a prefix of the text it decides the same way on the
whole text, so feeding a text in any chunk split (`ToolCallStream`) yields the same items as one
`parse`. A parser therefore holds back a suffix that could still become a call's start marker,
and decides a call only when its unit (tag block, JSON array, Python list) is complete; with
`final` (no more text) it decides everything, and an unfinished or malformed unit is content.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


Item = str | ToolCall


def call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": str, "arguments" | "parameters": object} as a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models send the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def could_start(tail: str, marker: str) -> bool:
    """True if `tail` is a proper prefix of `marker` (the text may still become it)."""
    return len(tail) < len(marker) and marker.startswith(tail)


def held_back(text: str, marker: str) -> int:
    """Where the longest suffix of `text` that could still become `marker` begins (len if none)."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if could_start(text[start:], marker):
            return start
    return len(text)


def held_back_pattern(text: str, prefix_pattern: re.Pattern[str], window: int = 32) -> int:
    """held_back for a start marker given as a regex that fullmatches every prefix of it."""
    for start in range(max(0, len(text) - window), len(text)):
        if prefix_pattern.fullmatch(text, start):
            return start
    return len(text)


class ToolCallParser(ABC):
    """One model family's tool-call format (see the module docstring for the invariant)."""

    name: ClassVar[str]

    @abstractmethod
    def step(self, pending: str, final: bool) -> tuple[list[Item], int]:
        """(decided items, characters of `pending` they consumed)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once: (content, calls)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        for item in self.items(text):
            if isinstance(item, ToolCall):
                calls.append(item)
            else:
                content.append(item)
        return "".join(content), calls

    def items(self, text: str) -> list[Item]:
        out: list[Item] = []
        while text:
            items, used = self.step(text, final=True)
            out.extend(items)
            if used <= 0:  # a final step decides everything; guard against a parser that did not
                out.append(text)
                break
            text = text[used:]
        return out
