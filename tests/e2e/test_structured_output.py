"""Structured output through the whole system (gateway -> tokenizer -> scheduler -> detokenizer,
each its own process): sampling_params json_schema / regex / ebnf on native /generate (streamed
and not) and on the public gRPC API, response_format json_object / json_schema on chat and
completions with the official openai client (n=2 included), and invalid grammars: HTTP 400 /
INVALID_ARGUMENT naming the field while a request beside them is unaffected."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from meshlm.launch.launcher import System
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.structured_schemas import EBNF, EBNF_TEXTS, MAX_NEW_TOKENS, REGEXES, SCHEMAS, prompt_for, schema_text

from .conftest import http_json, wait_idle

PERSON = SCHEMAS[0][1]
TICKET = SCHEMAS[19][1]


@pytest.fixture(scope="module")
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.http_url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def native(system: System, text: str, **sp) -> tuple[int, dict]:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, **sp}}
    return http_json(system.http_url + "/generate", body, timeout=180)


def native_stream(system: System, text: str, **sp) -> list[dict]:
    body = {"text": text, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, **sp}}
    req = urllib.request.Request(system.http_url + "/generate", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    events = []
    with urllib.request.urlopen(req, timeout=180) as r:  # noqa: S310 (loopback)
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_native_generate_json_schema_regex_ebnf_streamed_and_not(system: System) -> None:
    prompt = "Reply with JSON only: a person."
    with ThreadPoolExecutor(4) as pool:  # concurrently: they share batches
        plain = pool.submit(native, system, prompt, json_schema=schema_text(PERSON))
        events = pool.submit(native_stream, system, prompt, json_schema=schema_text(PERSON))
        rx = pool.submit(native, system, "Answer briefly.", regex=REGEXES[0])
        eb = pool.submit(native, system, "Answer briefly.", ebnf=EBNF)
    status, out = plain.result()
    assert status == 200, out
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(out["text"]), PERSON)
    streamed = events.result()
    assert len(streamed) > 1 and streamed[-1]["text"] == out["text"]  # cumulative text; greedy
    status, out = rx.result()
    assert status == 200 and re.fullmatch(REGEXES[0], out["text"]), out
    status, out = eb.result()
    assert status == 200 and out["text"] in EBNF_TEXTS, out


def test_chat_response_format_json_schema_and_json_object(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": prompt_for(SCHEMAS[19][0])}]
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET}}
    r = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt, n=2, temperature=0.8, seed=5, max_tokens=MAX_NEW_TOKENS
    )
    assert len(r.choices) == 2
    for choice in r.choices:  # each sequence has its own matcher
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), TICKET)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, response_format=fmt, temperature=0, max_tokens=MAX_NEW_TOKENS, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), TICKET)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=MAX_NEW_TOKENS,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_response_format(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt="A person as JSON:",
        temperature=0,
        max_tokens=MAX_NEW_TOKENS,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_grpc_generate_with_a_json_schema(system: System) -> None:
    async def call() -> list[tokenizer_pb2.GenerateResponse]:
        async with grpc.aio.insecure_channel(system.grpc_address) as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            req = tokenizer_pb2.GenerateRequest(
                prompts=[tokenizer_pb2.Prompt(text="Reply with JSON only: a person.")],
                sampling_params=common_pb2.SamplingParams(
                    temperature=0, max_new_tokens=MAX_NEW_TOKENS, json_schema=schema_text(PERSON)
                ),
                stream=True,
            )
            return [r async for r in stub.Generate(req, timeout=180)]

    responses = asyncio.run(call())
    jsonschema.validate(json.loads("".join(r.text for r in responses)), PERSON)


def test_invalid_grammars_are_400_and_invalid_argument(system: System, client: openai.OpenAI, model: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        good = pool.submit(native, system, "Reply with JSON only: a person.", json_schema=schema_text(PERSON))
        bad_regex = pool.submit(native, system, "x", regex="[a-")
        bad_schema = pool.submit(native, system, "x", json_schema=json.dumps({"type": "foo"}))
        not_json = pool.submit(native, system, "x", json_schema="{not json")
    for fut, field in ((bad_regex, "regex"), (bad_schema, "json_schema"), (not_json, "json_schema")):
        status, body = fut.result()
        assert status == 400, body
        assert f"sampling_params.{field}" in json.dumps(body), body
    status, out = good.result()
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(out["text"]), PERSON)
    with pytest.raises(openai.BadRequestError, match="sampling_params.json_schema"):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            max_tokens=8,
        )

    async def grpc_call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(system.grpc_address) as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            req = tokenizer_pb2.GenerateRequest(
                prompts=[tokenizer_pb2.Prompt(text="x")], sampling_params=common_pb2.SamplingParams(regex="(unclosed")
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in stub.Generate(req, timeout=60)]
            assert "sampling_params.regex" in err.value.details()
            return err.value.code()

    assert asyncio.run(grpc_call()) == grpc.StatusCode.INVALID_ARGUMENT
    wait_idle(system)
