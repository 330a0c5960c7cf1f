"""CompletionChunks and ChatChunks format a stream's per-token events without pydantic; each must be
byte for byte the event the pydantic models give (what the OpenAI clients of the e2e tests parse)."""

from __future__ import annotations

import itertools

import pytest

from meshlm.gateway.openai_outputs import ChatChunks, CompletionChunks
from meshlm.gateway.openai_protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from meshlm.gateway.outputs import sse

TEXTS = ["", " Paris", 'quote " backslash \\ slash /', "line\nbreak\ttab\r", "é 中文 🙂", "\x00\x1f\u2028\ud7ff"]
ENDS: list[tuple[str | None, int | str | None]] = [
    (None, None),
    ("length", None),
    ("stop", None),
    ("stop", 2),
    ("stop", "</s>"),
    ("stop", 'a "stop"'),
]


IDS = [("cmpl-1f3a", "SmolLM2-135M-Instruct"), ('r"1_0', "mödel/ü")]


@pytest.mark.parametrize(("rid", "model"), IDS)
def test_completion_events_equal_the_pydantic_models(rid: str, model: str) -> None:
    chunks = CompletionChunks(rid, 1733550000, model)
    for index, text, (finish, stop) in itertools.product((0, 3, 17), TEXTS, ENDS):
        choice = CompletionChoice(index=index, text=text, finish_reason=finish, matched_stop=stop)
        want = sse(
            CompletionStreamResponse(id=rid, created=1733550000, model=model, choices=[choice]).model_dump(mode="json")
        )
        assert chunks.event(index, text, finish, stop) == want


@pytest.mark.parametrize(("rid", "model"), IDS)
def test_chat_content_events_equal_the_pydantic_models(rid: str, model: str) -> None:
    chunks = ChatChunks(rid, 1733550000, model)
    for index, text in itertools.product((0, 3, 17), TEXTS):
        choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=text))
        want = sse(
            ChatCompletionChunk(id=rid, created=1733550000, model=model, choices=[choice]).model_dump(mode="json")
        )
        assert chunks.content_event(index, text) == want


def test_sse_json_is_compact_utf8_as_json_dumps_gives_it() -> None:
    """One shared encoder formats every event: the same text as json.dumps with the same options."""
    import json

    from meshlm.gateway.outputs import json_compact

    for value in [None, 3, 2.5, "é 中文 🙂 \u2028", {"a": ["x", None, True], "b": {"c": -1.0}}, []]:
        assert json_compact(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert json_compact({"k": ["é", None]}) == '{"k":["é",null]}'
