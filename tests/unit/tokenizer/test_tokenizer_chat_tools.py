"""What reaches the chat template: tools, the history's tool calls and tool results, name,
chat_template_kwargs and reasoning_effort, continue_final_message (as transformers renders each,
on a tools-aware template over SmolLM2's tokenizer), through the tokenizer's own request path
(tokenizer.proto ChatMessages → tokenize_prompt)."""

from __future__ import annotations

import json

import pytest
from tests.tool_template import tools_tokenizer_dir

from meshlm.tokenizer.hf_tokenizer import ChatTemplateError, HFTokenizer
from meshlm.tokenizer.request import InvalidRequest, tokenize_prompt
from meshlm.v1 import tokenizer_pb2

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?", "name": "alice"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tool_dir(smollm_path, tmp_path_factory):
    return tools_tokenizer_dir(smollm_path, tmp_path_factory.mktemp("tools_tok"))


@pytest.fixture(scope="module")
def tok(tool_dir) -> HFTokenizer:
    return HFTokenizer(tool_dir)


@pytest.fixture(scope="module")
def hf_tok(tool_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_dir))


def _proto(messages, **chat) -> tokenizer_pb2.Prompt:
    out = tokenizer_pb2.ChatMessages(**chat)
    for m in messages:
        pm = out.messages.add(role=m["role"], content=m["content"])
        if "name" in m:
            pm.name = m["name"]
        if "tool_call_id" in m:
            pm.tool_call_id = m["tool_call_id"]
        for c in m.get("tool_calls", []):
            pm.tool_calls.add(
                id=c["id"],
                type="function",
                name=c["function"]["name"],
                arguments=json.dumps(c["function"]["arguments"]),
            )
    return tokenizer_pb2.Prompt(messages=out)


def test_tool_round_trip_renders_as_transformers(tok, hf_tok):
    want = hf_tok.apply_chat_template(ROUND_TRIP, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    text, ids = tokenize_prompt(tok, _proto(ROUND_TRIP, tools_json=json.dumps([TOOL])), "prompts[0]", tok.vocab_size)
    assert text == want
    assert ids == tok.encode(want, add_special_tokens=False)
    # the template received each piece: the tools, the call (arguments as an object), the result, the name
    assert json.dumps(TOOL) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response id=call_1>\n{"temp_c": 21}\n</tool_response>' in text
    assert "<|im_start|>user name=alice\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(tok, hf_tok):
    msgs = [{"role": "user", "content": "hi"}]
    plain, _ = tokenize_prompt(tok, _proto(msgs), "p", tok.vocab_size)
    off, _ = tokenize_prompt(
        tok,
        _proto(msgs, chat_template_kwargs_json='{"enable_thinking": false, "reasoning_effort": "low"}'),
        "p",
        1 << 20,
    )
    assert off == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False, reasoning_effort="low"
    )
    assert off != plain and off.endswith("<think>\n\n</think>\n\n") and "Reasoning effort: low" in off
    with pytest.raises(InvalidRequest, match="chat_template_kwargs may not set messages"):
        tokenize_prompt(tok, _proto(msgs, chat_template_kwargs_json='{"messages": []}'), "p", tok.vocab_size)
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        tokenize_prompt(tok, _proto(msgs, chat_template_kwargs_json="[1]"), "p", tok.vocab_size)


@pytest.mark.parametrize("which", ["tools", "smollm"])
def test_continue_final_message_as_transformers(which, tok, hf_tok, smollm_path, smollm_tokenizer):
    ours, theirs = (tok, hf_tok) if which == "tools" else (HFTokenizer(smollm_path), smollm_tokenizer)
    msgs = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two, three,"}]
    want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    text, _ = tokenize_prompt(ours, _proto(msgs, continue_final_message=True), "p", ours.vocab_size)
    assert text == want and text.endswith("One, two, three,")
    closed, _ = tokenize_prompt(ours, _proto(msgs, add_generation_prompt=False), "p", ours.vocab_size)
    assert closed.startswith(text) and len(closed) > len(text)  # the end-of-turn is what was left out
    with pytest.raises(InvalidRequest, match="not compatible"):
        tokenize_prompt(ours, _proto(msgs, continue_final_message=True, add_generation_prompt=True), "p", 1 << 20)
    with pytest.raises(InvalidRequest, match="assistant message last"):
        tokenize_prompt(ours, _proto(msgs[:1], continue_final_message=True), "p", 1 << 20)


def test_template_failure_is_a_chat_template_error(tok):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": None}])  # str + None inside the template
