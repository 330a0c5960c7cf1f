"""Replicas: two tokenizers, two detokenizers and two schedulers serve 64 concurrent streams,
each delivered correctly to its own caller; then a detokenizer replica is killed under load, and,
once restarted, the other one. (Gateway and tokenizer kills: tests/e2e/frontend/.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from meshlm.launch.launcher import Child, System

from .conftest import start_system, wait_idle
from .frontend.clients import all_started, kill, native_body, native_stream, restart

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
    """SIGKILL of a detokenizer replica mid-stream (issue 12 part 3): the schedulers pushing to it fail
    over to the other and re-send every live request, so each stream ends, within a deadline, with its
    exact output (or at worst a clear error event, never a truncated stream); KV goes back to zero; new
    requests succeed; the detokenizer restarted with the same argv rejoins (with the other one killed
    in turn, every request is served through it alone)."""
    url = replicated.http_url
    first, other = replicated.by_component("detokenizer")

    async def kill_under_load(victim: Child, i0: int) -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            expected = await asyncio.gather(*(non_stream(c, url, i0 + i, 48) for i in range(16)))
            started = [asyncio.Event() for _ in range(16)]
            tasks = [
                asyncio.create_task(native_stream(c, url, native_body(i0 + i, 48, True), started[i])) for i in range(16)
            ]
            await all_started(started)
            kill(victim)
            ends = await asyncio.gather(*tasks)
            assert all(e.ok or e.error for e in ends), ends
            assert [e.text for e in ends if e.ok] == [x for x, e in zip(expected, ends, strict=True) if e.ok]
            assert sum(e.ok for e in ends) >= len(ends) // 2, ends
            after = await asyncio.gather(*(non_stream(c, url, i) for i in range(4)))
            assert all(after)

    asyncio.run(kill_under_load(first, 0))
    wait_idle(replicated, timeout=10)
    restart(first)
    asyncio.run(kill_under_load(other, 100))  # only the restarted one is left to serve
    wait_idle(replicated, timeout=10)
    restart(other)
