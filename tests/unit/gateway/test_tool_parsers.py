"""Each --tool-call-parser on its model format: the right calls and content from whole texts,
and the same from the stream of any chunk split (OpenAI tool-call deltas reassembled)."""

from __future__ import annotations

import json
import random

import pytest

from meshlm.gateway.function_call.registry import PARSERS, new_parser
from meshlm.gateway.function_call.stream import CallDelta, ToolCallStream

W = {"city": "Paris", "unit": "celsius"}
ADD = {"a": 1, "b": 2.5}
NESTED = {"q": 'say "hi" } ] \\ <tool_call>', "tags": ["x", "y"], "opts": {"deep": [1, {"k": None}]}, "ok": True}

# (parser, model text, expected content (stripped), expected calls [(name, arguments)])
CASES = [
    # hermes / qwen25
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [("get_weather", W)],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>',
        "Let me check.",
        [("get_weather", W), ("add", ADD)],
    ),
    (
        "qwen25",
        "<tool_call>\n" + json.dumps({"name": "nest", "arguments": NESTED}) + "\n</tool_call>",
        "",
        [("nest", NESTED)],
    ),
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2.5}"}</tool_call> done',
        "done",
        [("add", ADD)],
    ),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (
        "hermes",
        'I think <tool_call>{"name": "add", "arguments": {"a": 1',
        'I think <tool_call>{"name": "add", "arguments": {"a": 1',
        [],
    ),
    ("qwen25", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2.5}}', "", [("add", ADD)]),
    ("hermes", "No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
    # llama3_json
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", W)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": 2.5}}',
        "",
        [("get_weather", W), ("add", ADD)],
    ),
    (
        "llama3_json",
        'Sure, calling it: {"name": "nest", "arguments": ' + json.dumps(NESTED) + "}",
        "Sure, calling it:",
        [("nest", NESTED)],
    ),
    ("llama3_json", '{"name": "add", "parameters": [1, 2]}', '{"name": "add", "parameters": [1, 2]}', []),
    ("llama3_json", 'a set {1, 2} and {"title": "x"}', 'a set {1, 2} and {"title": "x"}', []),
    # mistral
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "",
        [("get_weather", W)],
    ),
    (
        "mistral",
        'Checking both.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "add", "arguments": {"a": 1, "b": 2.5}}]',
        "Checking both.",
        [("get_weather", W), ("add", ADD)],
    ),
    ("mistral", "[TOOL_CALLS] [" + json.dumps({"name": "nest", "arguments": NESTED}) + "]", "", [("nest", NESTED)]),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}',
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}',
        [],
    ),
    ("mistral", '[TOOL_CALLS] [{"arguments": {"a": 1}}]', '[TOOL_CALLS] [{"arguments": {"a": 1}}]', []),
    # pythonic
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", W)]),
    (
        "pythonic",
        "Two calls: [get_weather(city='Paris', unit='celsius'), add(a=1, b=2.5)]",
        "Two calls:",
        [("get_weather", W), ("add", ADD)],
    ),
    (
        "pythonic",
        "[nest(q='say \"hi\" } ] \\\\ <tool_call>', tags=['x', 'y'], opts={'deep': [1, {'k': None}]}, ok=True)]",
        "",
        [("nest", NESTED)],
    ),
    ("pythonic", "[add(1, 2)]", "[add(1, 2)]", []),
    ("pythonic", "[get_weather(city=unknown_name)]", "[get_weather(city=unknown_name)]", []),
    ("pythonic", "See [the docs] and [f(x=1", "See [the docs] and [f(x=1", []),
]


def _expected(calls):
    return [(name, args) for name, args in calls]


def _got(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parse_whole_text(parser, text, content, calls):
    got_content, got_calls = new_parser(parser).parse(text)
    assert got_content.strip() == content
    assert _got(got_calls) == _expected(calls)
    for c in got_calls:  # arguments are JSON text (OpenAI's shape)
        assert isinstance(c.arguments, str)


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_stream_any_split_reassembles(parser, text, content, calls):
    rng = random.Random(hash(text) & 0xFFFF)
    splits = [list(text)] + [_random_chunks(text, rng) for _ in range(6)]
    for chunks in splits:
        stream = ToolCallStream(parser=new_parser(parser))
        pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.finish()
        text_out = "".join(p for p in pieces if isinstance(p, str))
        assert text_out.strip() == content
        # OpenAI deltas: the first of a call has id + name (and "" arguments), then fragments
        assembled: dict[int, dict] = {}
        for p in pieces:
            if not isinstance(p, CallDelta):
                continue
            if p.index not in assembled:
                assert p.id and p.id.startswith("call_") and p.name and p.arguments == ""
                assembled[p.index] = {"id": p.id, "name": p.name, "arguments": ""}
            else:
                assert p.id is None and p.name is None
                assembled[p.index]["arguments"] += p.arguments
        assert sorted(assembled) == list(range(len(assembled)))
        got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(assembled.items())]
        assert got == _expected(calls)
        ids = [c["id"] for c in assembled.values()]
        assert len(set(ids)) == len(ids)


def test_parallel_tool_calls_false_keeps_the_first_call():
    stream = ToolCallStream(parallel=False, parser=new_parser("pythonic"))
    stream.feed("[add(a=1, b=2.5), get_weather(city='Paris', unit='celsius')]")
    stream.finish()
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [("add", ADD)]


def test_registry_names_and_unknown():
    assert {"hermes", "qwen25", "llama3_json", "mistral", "pythonic"} <= set(PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        new_parser("nope")
