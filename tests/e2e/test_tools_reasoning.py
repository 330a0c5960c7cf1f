"""Tool calling, reasoning and request fidelity through the official openai client against the
real services: the tokenizer serves SmolLM2 with a tools- and thinking-aware chat template
(tests/tool_template.py), the gateway runs --tool-call-parser hermes --reasoning-parser
deepseek-r1. Every response is also validated by the openai package's own types."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from meshlm.gateway.reasoning.parser import ReasoningSplit
from meshlm.gateway.reasoning.registry import style_of
from meshlm.launch.launcher import LaunchPlan, System, free_port, launch
from tests.tool_template import tools_tokenizer_dir

from .conftest import ENGINE_ARGS, http_json

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "description": "Forecast", "parameters": PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_forecast", "arguments": '{"city": "Paris", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"forecast": "sunny, 24 C"}'},
]


@pytest.fixture(scope="module")
def tools_system(smollm_path: str, tmp_path_factory) -> System:
    tok_dir = tools_tokenizer_dir(smollm_path, tmp_path_factory.mktemp("tools_tokenizer"))
    plan = LaunchPlan(
        model_path=smollm_path,
        tokenizer_path=str(tok_dir),
        http_port=free_port(),
        grpc_port=free_port(),
        scheduler_args=ENGINE_ARGS,
        gateway_args=("--tool-call-parser", "hermes", "--reasoning-parser", "deepseek-r1"),
        log_level="warning",
    )
    system = launch(plan, ready_timeout_s=180)
    yield system
    system.stop()


@pytest.fixture(scope="module")
def client(tools_system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_system.http_url + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _render(system: System, **body) -> tuple[list[int], str]:
    """The prompt /v1/chat/completions would send: /v1/tokenize of the chat, then its text."""
    status, tok = http_json(system.http_url + "/v1/tokenize", body)
    assert status == 200, tok
    status, text = http_json(
        system.http_url + "/v1/detokenize", {"tokens": tok["tokens"], "skip_special_tokens": False}
    )
    assert status == 200, text
    return tok["tokens"], text["text"]


def _raw_chat(system: System, body: dict) -> tuple[dict, list[dict]]:
    """The non-streamed JSON and the streamed chunks of one chat body, each validated by openai's types."""
    url = system.http_url + "/v1/chat/completions"
    whole = httpx.post(url, json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    ChatCompletion.model_validate(whole.json())
    chunks = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return whole.json(), chunks


def test_tool_round_trip_renders_through_the_template(tools_system, client, model):
    ids, text = _render(tools_system, messages=HISTORY, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text  # the template received `tools`
    assert '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert '<tool_response id=call_abc>\n{"forecast": "sunny, 24 C"}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    r = client.chat.completions.create(
        model=model,
        messages=HISTORY,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
        extra_body={"separate_reasoning": False},
    )
    assert r.usage.prompt_tokens == len(ids)  # the answer turn saw exactly that prompt
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_chat_template_kwargs_and_continue_final_message(tools_system, client, model):
    _, plain = _render(tools_system, messages=ASK)
    ids, off = _render(tools_system, messages=ASK, chat_template_kwargs={"enable_thinking": False})
    assert off == plain + "<think>\n\n</think>\n\n"
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.usage.prompt_tokens == len(ids)
    opened = [*ASK, {"role": "assistant", "content": "The weather in Paris will be"}]
    ids, text = _render(tools_system, messages=opened, continue_final_message=True, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\nThe weather in Paris will be")
    kw = dict(model=model, temperature=0, max_tokens=8)
    cont = client.chat.completions.create(
        messages=opened, extra_body={"continue_final_message": True, "separate_reasoning": False}, **kw
    )
    raw = httpx.post(tools_system.http_url + "/v1/completions", json={"prompt": ids, **kw}, timeout=120).json()
    completion = Completion.model_validate(raw)  # the openai package's own type
    assert cont.choices[0].message.content == completion.choices[0].text  # it continues the open message


def test_reasoning_split_of_the_real_model(tools_system):
    """deepseek-r1 style: the output starts inside the thinking; the split must equal what the
    parser makes of the raw text (separate_reasoning=false), streamed and not."""
    body = {"messages": ASK, "max_tokens": 24, "temperature": 0}
    raw, _ = _raw_chat(tools_system, {**body, "separate_reasoning": False})
    text = raw["choices"][0]["message"]["content"]
    assert text and "reasoning_content" not in raw["choices"][0]["message"]
    split = ReasoningSplit(style_of("deepseek-r1"))
    split.feed(text)
    split.finish()
    want = ("".join(split.reasoning).strip() or None, "".join(split.content).strip())
    whole, chunks = _raw_chat(tools_system, body)
    msg = whole["choices"][0]["message"]
    assert (msg.get("reasoning_content"), msg["content"]) == want and want[0]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = (
        "".join(d.get("reasoning_content") or "" for d in deltas),
        "".join(d.get("content") or "" for d in deltas),
    )
    assert (streamed[0].strip() or None, streamed[1].strip()) == want


def test_reasoning_split_of_a_think_block(tools_system):
    """A regex makes the real model write `<think>...</think>answer`: the parts come apart."""
    body = {
        "messages": ASK,
        "max_tokens": 48,
        "temperature": 0,
        "regex": r"<think>[a-z ]{4,24}</think>\n\n[A-Z][a-z ]{4,24}\.",
    }
    whole, chunks = _raw_chat(tools_system, body)
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] and "think>" not in msg["reasoning_content"] + msg["content"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas).strip() == msg["content"]


def _calls_of(whole: dict, chunks: list[dict]) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    parts: dict[int, dict] = {}
    for c in chunks:
        for d in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            if d["index"] not in parts:
                assert d["id"].startswith("call_") and d["function"]["name"]
                parts[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"].get("arguments", "")}
            else:
                parts[d["index"]]["arguments"] += d["function"]["arguments"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]
    streamed = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    for name, args in got + streamed:
        jsonschema.validate(args, SCHEMAS[name])
    return got, streamed


@pytest.mark.parametrize("choice", ["named", "required"])
def test_constrained_tool_choice_returns_valid_calls(tools_system, client, model, choice):
    tool_choice = {"type": "function", "function": {"name": "get_forecast"}} if choice == "named" else "required"
    body = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 96}
    # greedy, one call (the tiny model would repeat its call until max_tokens with parallel calls)
    greedy = {**body, "temperature": 0, "parallel_tool_calls": False}
    got, streamed = _calls_of(*_raw_chat(tools_system, greedy))
    assert len(got) == 1 and got == streamed
    if choice == "named":
        assert [n for n, _ in got] == ["get_forecast"]
    # and through the client, sampled, parallel calls allowed: every call returned is valid
    r = client.chat.completions.create(**{**body, "temperature": 0.8, "seed": 3})
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason in ("tool_calls", "length")
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_tool_choice_parses_model_output(tools_system, model):
    """The hermes parser on the real output: a regex makes the model write a tool-call block."""
    body = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 64,
        "temperature": 0,
        "separate_reasoning": False,
        "regex": r'Checking\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>',
    }
    got, streamed = _calls_of(*_raw_chat(tools_system, body))
    assert [n for n, _ in got] == ["add"] and got == streamed
