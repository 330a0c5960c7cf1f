"""The gateway's OpenAI routes in front of a fake TokenizerService: request mapping, response shapes,
SSE, errors (the native routes: test_gateway_native.py)."""

from __future__ import annotations

import base64
import struct

import grpc
import openai
import pytest
from gateway_testlib import MODEL, last_request, sse_events


def oai(client) -> openai.OpenAI:
    return openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=client, max_retries=0)


# ---------------------------------------------------------------------------- completions


def test_completion_maps_request_and_response(client, fake_tokenizer):
    body = {
        "model": MODEL,
        "prompt": "a b c",
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "stop": "x",
        "top_k": 5,
        "min_p": 0.1,
        "min_tokens": 1,
        "repetition_penalty": 1.1,
        "stop_token_ids": [9],
        "ignore_eos": True,
        "logit_bias": {"5": 1.5},
        "frequency_penalty": 0.2,
        "presence_penalty": -0.2,
        "rid": "my-rid",
        "user": "u",
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL and out["id"] == "my-rid"
    assert out["choices"] == [
        {"index": 0, "text": " w0 w1 w2", "logprobs": None, "finish_reason": "length", "matched_stop": None}
    ]
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    req = last_request(fake_tokenizer)
    assert req.rid == "my-rid" and not req.stream and req.prompts[0].text == "a b c"
    sp = req.sampling_params
    assert (sp.max_new_tokens, sp.temperature, sp.sampling_seed, list(sp.stop), sp.top_k) == (3, 0.5, 7, ["x"], 5)
    assert (sp.min_new_tokens, list(sp.stop_token_ids), sp.ignore_eos, dict(sp.logit_bias)) == (1, [9], True, {5: 1.5})
    assert abs(sp.top_p - 0.9) < 1e-6 and abs(sp.repetition_penalty - 1.1) < 1e-6
    assert not sp.HasField("skip_special_tokens")  # unset = server default


def test_completion_defaults(client, fake_tokenizer):
    out = client.post("/v1/completions", json={"prompt": "hi"}).json()
    assert out["choices"][0]["text"] == "".join(f" w{k}" for k in range(16))  # OpenAI's max_tokens=16
    sp = last_request(fake_tokenizer).sampling_params
    assert sp.max_new_tokens == 16 and not sp.HasField("temperature") and not sp.HasField("top_p")


def test_completion_batch_and_n(client, fake_tokenizer):
    out = client.post("/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "max_tokens": 1}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 3  # once per prompt, not per sample
    assert out["usage"]["completion_tokens"] == 4
    req = last_request(fake_tokenizer)
    assert [p.text for p in req.prompts] == ["a", "b c"] and req.sampling_params.n == 2
    client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert [list(p.input_ids.ids) for p in last_request(fake_tokenizer).prompts] == [[1, 2], [3]]


def test_completion_stop_and_logprobs(client, fake_tokenizer):
    out = client.post("/v1/completions", json={"prompt": "x STOP", "logprobs": 2}).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "STOP"
    assert choice["logprobs"] == {
        "tokens": [" w0"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{" w0": -0.5, " w1": -1.5}],
        "text_offset": [0],
    }
    req = last_request(fake_tokenizer)
    assert req.return_logprob and req.top_logprobs_num == 2 and req.return_text_in_logprobs
    assert not req.HasField("logprob_start_len")


def test_completion_echo(client, fake_tokenizer):
    out = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "echo": True, "logprobs": 0}).json()
    choice = out["choices"][0]
    assert choice["text"] == "a b w0 w1"
    assert choice["logprobs"]["tokens"] == ["a", " b", " w0", " w1"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -0.5, -0.5]
    assert choice["logprobs"]["text_offset"] == [0, 1, 3, 6]
    assert choice["logprobs"]["top_logprobs"] is None
    assert last_request(fake_tokenizer).logprob_start_len == 0
    ids = client.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 1, "echo": True}).json()
    assert ids["choices"][0]["text"] == "t4 t5 w0"  # token prompts are detokenized for the echo


def test_completion_stream(client, fake_tokenizer):
    response = client.post(
        "/v1/completions",
        json={"prompt": "a", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse_events(response)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" w0", " w1", " w2"]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "length"]
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 4
    assert last_request(fake_tokenizer).stream


def test_completion_stream_echo_logprobs(client):
    response = client.post(
        "/v1/completions", json={"prompt": "a b", "max_tokens": 2, "stream": True, "echo": True, "logprobs": 1}
    )
    events = sse_events(response)
    assert "".join(e["choices"][0]["text"] for e in events) == "a b w0 w1"
    tokens = sum((e["choices"][0]["logprobs"]["tokens"] for e in events), [])
    offsets = sum((e["choices"][0]["logprobs"]["text_offset"] for e in events), [])
    assert tokens == ["a", " b", " w0", " w1"] and offsets == [0, 1, 3, 6]


# ---------------------------------------------------------------------------- chat


def test_chat(client, fake_tokenizer):
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        ],
        "max_tokens": 50,
        "max_completion_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " w0 w1"}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [" w0", " w1"]
    assert content[0]["bytes"] == list(b" w0") and content[0]["top_logprobs"][0]["token"] == " w0"
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    req = last_request(fake_tokenizer)
    assert req.sampling_params.max_new_tokens == 2  # max_completion_tokens wins over max_tokens
    messages = req.prompts[0].messages
    assert [(m.role, m.content) for m in messages.messages] == [("system", "be brief"), ("user", "hi there")]
    assert messages.add_generation_prompt


def test_chat_stream(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(response)
    by_index: dict[int, list] = {}
    for e in events[:-1]:
        assert e["object"] == "chat.completion.chunk" and len(e["choices"]) == 1
        by_index.setdefault(e["choices"][0]["index"], []).append(e["choices"][0])
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == " w0 w1"
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert sorted(by_index) == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_openai_client_end_to_end(client):
    api = oai(client)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=1, temperature=0
    )
    assert chat.choices[0].message.content == " w0 w1 w2" and chat.usage.total_tokens == 4
    chunks = list(
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " w0 w1"
    assert chunks[-1].usage.completion_tokens == 2
    completion = api.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=1)
    assert completion.choices[0].logprobs.tokens == [" w0"]
    embedding = api.embeddings.create(model=MODEL, input=["a", "b c"])  # the client asks for base64
    assert [d.embedding for d in embedding.data] == [[0.5, -0.25, 0.0], [0.5, -0.25, 1.0]]
    assert embedding.usage.prompt_tokens == 3
    assert [m.id for m in api.models.list()] == [MODEL]


def test_embeddings_float(client):
    out = client.post("/v1/embeddings", json={"input": [[1, 2, 3]], "encoding_format": "float"}).json()
    assert out["object"] == "list" and out["model"] == MODEL
    assert out["data"] == [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25, 0.0]}]
    b64 = client.post("/v1/embeddings", json={"input": "a", "encoding_format": "base64"}).json()
    assert struct.unpack("<3f", base64.b64decode(b64["data"][0]["embedding"])) == (0.5, -0.25, 0.0)


# ---------------------------------------------------------------------------- errors from the tokenizer


@pytest.mark.parametrize(
    "code,status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_errors_map_to_http(client, fake_tokenizer, code, status, stream):
    message = "prompt has 5000 tokens but the context length is 2048"
    fake_tokenizer.servicer.error = (code, message)
    response = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    assert response.status_code == status
    assert response.json()["error"]["message"].endswith(message)  # passed through
    assert (response.headers.get("retry-after") == "1") == (status == 503)


def test_openai_client_sees_context_error(client, fake_tokenizer):
    message = "input length 5000 exceeds the context length 2048"
    fake_tokenizer.servicer.error = (grpc.StatusCode.INVALID_ARGUMENT, message)
    with pytest.raises(openai.BadRequestError) as info:
        oai(client).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert message in info.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_abort_finish_is_an_error(client, fake_tokenizer, stream):
    fake_tokenizer.servicer.abort_finish = (400, "the prompt is too long (5000 > 2048)")
    response = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": stream}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the prompt is too long (5000 > 2048)"
    fake_tokenizer.servicer.abort_finish = (503, "queue full")
    response = client.post("/generate", json={"text": "x", "stream": stream})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
