"""One choice's tool calls as a stream: text deltas in, content and OpenAI tool-call deltas out.

`ToolCallStream` drives a format parser (base.py) over the growing text; `NamedCallStream` and
`RequiredCallStream` read the output of constrained decoding (tool_choice named / required,
constrained.py), which is pure JSON. All three give, per call, a first delta with the call's
index, id (`call_<hex>`), type and name and empty arguments, then the arguments as fragments;
the non-streamed message is the same pieces gathered (`CallStream.collect`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from meshlm.gateway.function_call.base import ToolCall, ToolCallParser, call_of
from meshlm.gateway.function_call.json_scan import value_end


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: the start (id and name set, arguments "") or an arguments fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Piece = str | CallDelta


@dataclass
class CollectedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class CallStream:
    """The shared part: call numbering and the non-stream collection of pieces."""

    parallel: bool = True
    calls: list[CollectedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def _start(self, call: ToolCall, whole: bool) -> list[Piece]:
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls=false: the first call only
        index = len(self.calls)
        self.calls.append(CollectedCall(new_call_id(), call.name))
        out: list[Piece] = [CallDelta(index, "", self.calls[-1].id, call.name)]
        if whole:
            out += self._args(index, call.arguments)
        return out

    def _args(self, index: int, text: str) -> list[Piece]:
        if not text:
            return []
        self.calls[index].arguments += text
        return [CallDelta(index, text)]

    def _text(self, text: str) -> list[Piece]:
        if not text:
            return []
        self.content.append(text)
        return [text]

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    def collect(self, text: str) -> tuple[str, list[CollectedCall]]:
        """The whole output at once: (content, calls)."""
        self.feed(text)
        self.finish()
        return "".join(self.content), self.calls


@dataclass
class ToolCallStream(CallStream):
    """Drives a format parser; holds only the text the parser has not decided yet."""

    parser: ToolCallParser | None = None
    pending: str = ""

    def _run(self, final: bool) -> list[Piece]:
        assert self.parser is not None
        out: list[Piece] = []
        while self.pending:
            items, used = self.parser.step(self.pending, final)
            for item in items:
                out += self._start(item, whole=True) if isinstance(item, ToolCall) else self._text(item)
            if used <= 0:
                if final:  # cannot happen with a well-behaved parser: never lose text
                    out += self._text(self.pending)
                    self.pending = ""
                break
            self.pending = self.pending[used:]
        return out

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)


@dataclass
class NamedCallStream(CallStream):
    """tool_choice named: the output is the function's arguments; each delta is a fragment."""

    function: str = ""
    started: bool = False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if not self.started:
            self.started = True
            out += self._start(ToolCall(self.function, ""), whole=False)
        return out + self._args(0, text)

    def finish(self) -> list[Piece]:
        return self.feed("") if not self.started else []


@dataclass
class RequiredCallStream(CallStream):
    """tool_choice required: the output is a JSON list of {"name", "parameters"}. Each item is a
    call as soon as it is complete, so a list cut short by max_tokens still gives its complete
    calls; what cannot be read as calls (an unfinished last item, or no list at all) is content."""

    buffer: str = ""
    at: int = 0  # buffer[:at] is decided
    opened: bool = False
    closed: bool = False

    def _skip(self, chars: str) -> None:
        while self.at < len(self.buffer) and (self.buffer[self.at].isspace() or self.buffer[self.at] in chars):
            self.at += 1

    def _read(self) -> list[Piece]:
        out: list[Piece] = []
        while not self.closed:
            self._skip("")
            if self.at >= len(self.buffer):
                break
            if not self.opened:
                if self.buffer[self.at] != "[":
                    break
                self.opened, self.at = True, self.at + 1
                continue
            self._skip(",")
            if self.at >= len(self.buffer):
                break
            if self.buffer[self.at] == "]":
                self.closed, self.at = True, self.at + 1
                break
            if self.buffer[self.at] != "{":
                break
            end = value_end(self.buffer, self.at)
            if end is None:
                break
            try:
                call = call_of(json.loads(self.buffer[self.at : end]), ("parameters", "arguments"))
            except ValueError:
                call = None
            if call is None:
                break
            out += self._start(call, whole=True)
            self.at = end
        return out

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        return self._read()

    def finish(self) -> list[Piece]:
        out = self._read()
        rest = self.buffer[self.at :]
        if not self.calls:
            rest = self.buffer  # not a list of calls at all: all of it is content
        return out + self._text(rest if rest.strip() else "")
