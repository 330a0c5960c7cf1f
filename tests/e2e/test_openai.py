"""The official openai client against a launched system (gateway → tokenizer → scheduler →
detokenizer, each its own process)."""

from __future__ import annotations

import openai
import pytest

from meshlm.launch.launcher import System

from .conftest import http_json, wait_idle


@pytest.fixture(scope="module")
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models(client: openai.OpenAI, model: str) -> None:
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_stream_and_usage(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model: str) -> None:
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        temperature=0,
        max_tokens=24,
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_n2_logprobs_echo_stop(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=8, n=2, temperature=0.9, seed=7, logprobs=2
    )
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    e = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=4, temperature=0, echo=True)
    assert e.choices[0].text.startswith("The quick brown fox")
    s = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=32, temperature=0, stop=["7"])
    assert "7" not in s.choices[0].text and s.choices[0].finish_reason == "stop"


def test_embeddings(client: openai.OpenAI, model: str) -> None:
    r = client.embeddings.create(model=model, input=["hello world", "bonjour le monde"])
    assert len(r.data) == 2 and len(r.data[0].embedding) > 16
    norm = sum(x * x for x in r.data[0].embedding) ** 0.5
    assert abs(norm - 1.0) < 1e-3


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_are_400(client: openai.OpenAI, model: str, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert param in str(exc.value)


def test_bad_requests_keep_server_serving(system: System, client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as exc:  # longer than the context (8192 tokens)
        client.completions.create(model=model, prompt="hello " * 9000, max_tokens=4)
    assert "context" in str(exc.value)
    status, body = http_json(system.http_url + "/v1/chat/completions", {"model": model, "messages": "hi"})
    assert status == 400 and "error" in body
    import urllib.request

    req = urllib.request.Request(system.http_url + "/v1/completions", data=b"{not json", method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("invalid JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert ok.choices[0].text
    wait_idle(system)


def test_non_ascii_and_emoji_stream_cleanly(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        stream=True,
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "Réponds en français avec des emoji 🌊: 你好吗？"}],
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas)
