"""--reasoning-parser styles on fixture texts, whole and streamed in any chunk split, and the
chat plan's choice parts (reasoning + tool calls, constrained tool_choice) as one message."""

from __future__ import annotations

import json
import random

import pytest

from meshlm.gateway.config import GatewayConfig
from meshlm.gateway.errors import APIError
from meshlm.gateway.openai_chat import plan_chat
from meshlm.gateway.openai_protocol import ChatCompletionRequest
from meshlm.gateway.reasoning.parser import ReasoningSplit
from meshlm.gateway.reasoning.registry import STYLES, style_of

# (style, model text, reasoning, content)
CASES = [
    (
        "deepseek-r1",
        "Let me think: 2+2 is 4.\n</think>\n\nThe answer is 4.",
        "Let me think: 2+2 is 4.",
        "The answer is 4.",
    ),
    ("deepseek-r1", "<think>\nHmm, Paris.</think>Paris.", "Hmm, Paris.", "Paris."),
    ("deepseek-r1", "Still thinking when cut off", "Still thinking when cut off", ""),
    ("deepseek-r1", "a < b but </thin is not the end</think>done", "a < b but </thin is not the end", "done"),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    (
        "qwen3",
        "Hello! No thinking here, <think> in the middle stays.",
        "",
        "Hello! No thinking here, <think> in the middle stays.",
    ),
    ("qwen3", "  \n<think>x</think>y", "x", "y"),
    ("qwen3", "<think>unfinished", "unfinished", ""),
    ("qwen3", "<thinking> is not the tag", "", "<thinking> is not the tag"),
]


def _run(style: str, chunks: list[str]) -> tuple[str, str]:
    split = ReasoningSplit(style_of(style))
    r, c = [], []
    for chunk in chunks:
        a, b = split.feed(chunk)
        r.append(a)
        c.append(b)
    a, b = split.finish()
    r.append(a)
    c.append(b)
    assert "".join(r) == "".join(split.reasoning) and "".join(c) == "".join(split.content)
    return "".join(r), "".join(c)


@pytest.mark.parametrize("style,text,reasoning,content", CASES)
def test_reasoning_split_whole_and_streamed(style, text, reasoning, content):
    assert tuple(s.strip() for s in _run(style, [text])) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(10, len(text) - 1))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        got = _run(style, chunks)
        assert tuple(s.strip() for s in got) == (reasoning, content), chunks
        assert "<think>" not in got[0] and "</think>" not in got[0]  # the markers are in neither part
    assert tuple(s.strip() for s in _run(style, list(text))) == (reasoning, content)


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    },
    {"type": "function", "function": {"name": "echo"}},
]


def _message(plan, chunks):
    parts = plan.new_choice()
    deltas = [parts.feed(c) for c in chunks] + [parts.finish()]
    return parts, [d for d in deltas if d is not None]


def test_reasoning_then_tool_call_streamed_and_whole():
    config = GatewayConfig(tool_call_parser="hermes", reasoning_parser="qwen3")
    plan = plan_chat(_chat(tools=TOOLS), config)
    text = '<think>I should add.</think>\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    parts, _ = _message(plan, [text])
    msg = parts.message()
    assert msg.reasoning_content == "I should add." and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("add", {"a": 2})]
    parts, deltas = _message(plan, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert "".join(d.reasoning_content or "" for d in deltas) == "I should add."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "add"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"a": 2}


def test_enable_thinking_false_and_separate_reasoning_false_turn_the_split_off():
    config = GatewayConfig(reasoning_parser="deepseek-r1")
    assert plan_chat(_chat(), config).reasoning is STYLES["deepseek-r1"]
    assert plan_chat(_chat(chat_template_kwargs={"enable_thinking": False}), config).reasoning is None
    assert plan_chat(_chat(separate_reasoning=False), config).reasoning is None
    parts, _ = _message(plan_chat(_chat(), config), ["why</think>because"])
    assert (parts.message().reasoning_content, parts.message().content) == ("why", "because")


def test_constrained_tool_choice_schemas_and_reading():
    config = GatewayConfig()
    named = plan_chat(_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), config)
    assert json.loads(named.tool_schema) == TOOLS[0]["function"]["parameters"]
    parts, deltas = _message(named, ['{"a":', " 7}"])
    assert deltas[0].tool_calls[0].function.name == "add" and deltas[0].tool_calls[0].id.startswith("call_")
    assert [tc.function.arguments for d in deltas for tc in d.tool_calls] == ["", '{"a":', " 7}"]
    required = plan_chat(_chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), config)
    schema = json.loads(required.tool_schema)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["add"], ["echo"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    parts, _ = _message(required, ['[{"name": "echo", "parameters": {"x": 1}}]'])
    assert [(c.function.name, c.function.arguments) for c in parts.message().tool_calls] == [("echo", '{"x": 1}')]
    # a list cut short by max_tokens: its complete calls, streamed as each one closes; the rest is content
    parallel = plan_chat(_chat(tools=TOOLS, tool_choice="required"), config)
    text = '[\n {"name": "add", "parameters": {"a": 2}},\n {"name": "echo", "parameters": {}},\n {"name": "add", "para'
    parts, deltas = _message(parallel, [text[i : i + 5] for i in range(0, len(text), 5)])
    assert [(c.function.name, c.function.arguments) for c in parts.message().tool_calls] == [
        ("add", '{"a": 2}'),
        ("echo", "{}"),
    ]
    assert parts.message().content == '{"name": "add", "para'
    first_echo = next(i for i, d in enumerate(deltas) for tc in d.tool_calls or [] if tc.function.name == "echo")
    assert first_echo < len(deltas) - 1  # emitted before the end of the output
    parts, _ = _message(parallel, ["no list here"])
    assert parts.message().content == "no list here" and parts.message().tool_calls is None


@pytest.mark.parametrize(
    "kw,config,needle",
    [
        ({"tool_choice": "auto"}, {}, "tool_choice needs tools"),
        ({"tools": TOOLS}, {}, "--tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, {}, "'nope'"),
    ],
)
def test_bad_tool_choice_is_a_400(kw, config, needle):
    with pytest.raises(APIError) as e:
        plan_chat(_chat(**kw), GatewayConfig(**config))
    assert e.value.status == 400 and needle in e.value.message
