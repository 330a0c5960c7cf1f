"""Replicas: two tokenizers, two detokenizers and two schedulers serve 64 concurrent streams,
each delivered correctly to its own caller; then a detokenizer replica is killed under load."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import httpx
import pytest

from meshlm.launch.launcher import System

from .conftest import start_system, wait_idle

N_STREAMS = 64


@pytest.fixture(scope="module")
def replicated(smollm_path: str) -> Iterator[System]:
    sys_ = start_system(smollm_path, dp_size=2, tokenizer_replicas=2, detokenizer_replicas=2)
    yield sys_
    sys_.stop()


def prompt(i: int) -> str:
    return f"Request {i}: repeat the number {i} three times."


async def stream_one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int = 16) -> str:
    body = {"text": prompt(i), "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}, "stream": True}
    text = ""
    async with client.stream("POST", url + "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                import json

                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                text = chunk["text"]  # native streaming is cumulative
    return text


async def non_stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int = 16) -> str:
    body = {"text": prompt(i), "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    r = await client.post(url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def test_64_concurrent_streams_each_correct(replicated: System) -> None:
    url = replicated.http_url

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            expected = await asyncio.gather(*(non_stream(c, url, i) for i in range(N_STREAMS)))
            got = await asyncio.gather(*(stream_one(c, url, i) for i in range(N_STREAMS)))
        assert got == expected

    asyncio.run(run())
    wait_idle(replicated)


def test_killing_a_detokenizer_under_load(replicated: System) -> None:
    url = replicated.http_url

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            expected = await asyncio.gather(*(non_stream(c, url, i, 48) for i in range(16)))
            tasks = [asyncio.create_task(stream_one(c, url, i, 48)) for i in range(16)]
            await asyncio.sleep(1.0)
            victim = replicated.by_component("detokenizer")[0]
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for exp, res in zip(expected, results):
                # Each in-flight stream either finished with the right text or ended with a clear error.
                if not isinstance(res, BaseException):
                    assert res == exp
            after = await asyncio.gather(*(non_stream(c, url, i) for i in range(4)))
            assert all(after)

    asyncio.run(run())
    wait_idle(replicated, timeout=10)
