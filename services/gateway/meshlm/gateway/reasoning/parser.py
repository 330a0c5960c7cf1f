"""A choice's output split into reasoning and content, as a stream.

The thinking is the text between `<think>` and `</think>`. A style says whether the output
starts inside the thinking (the chat template already opened `<think>`, DeepSeek-R1's) or only
when the output itself opens with `<think>` (Qwen3's). Invariants: feeding a text in any chunk
split gives the same reasoning and content as feeding it whole (a suffix that could still be a
marker is held back until it is decided); the markers never appear in either part; whitespace
at the start of the reasoning and of the content after `</think>` is dropped; a thinking the
model never closed is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshlm.gateway.function_call.base import could_start, held_back

Mode = Literal["start", "reasoning", "content"]


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False


@dataclass
class ReasoningSplit:
    """Per choice: `feed` returns (reasoning delta, content delta); `finish` flushes."""

    style: ReasoningStyle
    mode: Mode = "start"
    pending: str = ""
    skip_space: bool = True
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, str]:
        return self._run(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> tuple[str, str]:
        self.pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.skip_space:
                stripped = self.pending.lstrip()
                if not stripped and not final:
                    self.pending = ""
                    break
                self.pending = stripped
            if self.mode == "start":
                if self.pending.startswith(self.style.start):
                    self.pending = self.pending[len(self.style.start) :]
                    self.mode = "reasoning"
                    continue
                if not final and could_start(self.pending, self.style.start):
                    break
                self.mode = "reasoning" if self.style.starts_in_reasoning else "content"
                self.skip_space = self.mode == "reasoning"
                continue
            if self.mode == "reasoning":
                at = self.pending.find(self.style.end)
                if at >= 0:
                    reasoning.append(self.pending[:at])
                    self.pending = self.pending[at + len(self.style.end) :]
                    self.mode = "content"
                    self.skip_space = True
                    continue
                keep = len(self.pending) if final else held_back(self.pending, self.style.end)
                reasoning.append(self.pending[:keep])
                self.pending = self.pending[keep:]
                if reasoning[-1]:
                    self.skip_space = False
                break
            content.append(self.pending)
            if self.pending:
                self.skip_space = False
            self.pending = ""
            break
        r, c = "".join(reasoning), "".join(content)
        if r:
            self.reasoning.append(r)
        if c:
            self.content.append(c)
        return r, c
