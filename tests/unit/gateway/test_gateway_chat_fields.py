"""The chat route's new request fields reach the tokenizer's ChatMessages (tools, tool calls,
tool results, name, chat_template_kwargs, reasoning_effort, continue_final_message, the
constraint of tool_choice required), and unsupported fields are logged or, with --strict-api,
a 400 naming them (fake TokenizerService)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient
from gateway_testlib import MODEL, last_request, make_config

from meshlm.gateway.app import create_app

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "developer", "content": "be brief", "name": "ops"},
    {"role": "user", "content": "add 1 and 2", "name": "bob"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
    },
    {"role": "tool", "content": "3", "tool_call_id": "call_9"},
]


def test_chat_fields_reach_the_tokenizer(client, fake_tokenizer):
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": HISTORY,
            "tools": TOOLS,
            "tool_choice": "required",
            "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "high",
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200, r.text
    chat = last_request(fake_tokenizer).prompts[0].messages
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[0].name == "ops" and chat.messages[1].name == "bob"
    assert not chat.messages[2].HasField("name")
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.type, call.name, call.arguments) == ("call_9", "function", "add", '{"a": 1}')
    assert chat.messages[3].tool_call_id == "call_9"
    assert json.loads(chat.tools_json) == TOOLS
    assert json.loads(chat.chat_template_kwargs_json) == {"enable_thinking": False, "reasoning_effort": "high"}
    assert chat.add_generation_prompt and not chat.continue_final_message
    schema = json.loads(last_request(fake_tokenizer).sampling_params.json_schema)
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["add"]
    # the fake's output (" w0 w1") is not a list of calls: it stays content
    assert r.json()["choices"][0]["message"]["content"] == "w0 w1"


def test_continue_final_message(client, fake_tokenizer):
    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one,"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True, "max_tokens": 1})
    assert r.status_code == 200
    chat = last_request(fake_tokenizer).prompts[0].messages
    assert chat.continue_final_message and not chat.add_generation_prompt
    both = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True}
    r = client.post("/v1/chat/completions", json=both)
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]


def test_unsupported_fields_are_logged_once(client, fake_tokenizer, caplog):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}],
        "max_tokens": 1,
        "web_search_options": {},
        "prediction": {"type": "content", "content": "x"},
    }
    with caplog.at_level(logging.WARNING, logger="meshlm.gateway.openai_fields"):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.name == "meshlm.gateway.openai_fields"]
    assert len(warnings) == 1
    assert "web_search_options, prediction, messages[0].audio" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshlm.gateway.openai_fields"):
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "tools": TOOLS})
    assert [r.getMessage() for r in caplog.records][-1].endswith("ignoring unsupported fields: tools")


def test_strict_api_rejects_unsupported_fields(fake_tokenizer):
    config = make_config(tokenizer_addrs=(fake_tokenizer.address,), strict_api=True)
    with TestClient(create_app(config)) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "metadata": {"k": "v"}}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "metadata" in err["message"] and err["param"] == "metadata"
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "foo": 1}).status_code == 400
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": TOOLS, "tool_choice": "none"}
        assert c.post("/v1/chat/completions", json=ok).status_code == 200


@pytest.mark.parametrize("flag,value", [("tool_call_parser", "nope"), ("reasoning_parser", "nope")])
def test_unknown_parser_flags_are_refused(flag, value):
    with pytest.raises(ValueError, match=flag):
        make_config(**{flag: value})


def test_tool_parser_output_through_the_route(fake_tokenizer):
    config = make_config(tokenizer_addrs=(fake_tokenizer.address,), tool_call_parser="pythonic")
    with TestClient(create_app(config)) as c:
        # the fake answers with the prompt's words w0 w1...: not a call, so content and "length"
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 2},
        )
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "w0 w1" and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "length"
