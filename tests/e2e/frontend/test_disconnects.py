"""1,000 streaming requests with random client disconnects at random points (issue 12): native
/generate and OpenAI chat SSE streams through the gateway (httpx, closing the connection before
the response, after the headers or after k chunks) and public-API gRPC streams on both tokenizer
replicas (the call cancelled before or after k responses). Disconnected requests ask for 512
tokens with ignore_eos, so one whose abort were lost would hold its KV far past the idle deadline.
Afterwards the scheduler runs nothing and holds no KV tokens, every stream that was read to its
end has the output computed before the storm, and a golden request still answers correctly."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx

from meshlm.launch.launcher import System
from meshlm.v1 import tokenizer_pb2_grpc

from ..conftest import wait_idle
from .clients import grpc_request, native_body, native_once

N_REQUESTS = 1000
N_GRPC = 150
CONCURRENCY = 64
PROMPTS = 8  # distinct prompts (request i uses prompt i % PROMPTS), golden computed for each
SHORT = 8  # tokens of a request read to its end
LONG = 512  # tokens of a request the client leaves (ignore_eos)


async def http_one(c: httpx.AsyncClient, url: str, i: int, leave_after: int | None, chat: bool) -> str | None:
    """One SSE request; leave_after None = read to the end (returns the text), -1 = leave before the
    response, k >= 0 = leave after k data chunks."""
    n = SHORT if leave_after is None else LONG
    if chat:
        path = "/v1/chat/completions"
        body: dict = {
            "messages": [{"role": "user", "content": f"Count to {i % PROMPTS}."}],
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "ignore_eos": leave_after is not None,
        }
    else:
        path = "/generate"
        body = native_body(i % PROMPTS, n, True, sampling={"ignore_eos": leave_after is not None})
    if leave_after == -1:
        task = asyncio.ensure_future(c.post(url + path, json=body))
        await asyncio.sleep(random.uniform(0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    text, chunks, finished = "", 0, False
    async with c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if leave_after is not None and chunks >= leave_after:
                return None  # leaving the block closes the connection mid-stream
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[5:])
            assert "error" not in chunk, chunk
            chunks += 1
            if chat:
                choice = chunk["choices"][0]
                text += choice["delta"].get("content") or ""
                finished = finished or choice["finish_reason"] is not None
            else:
                text, finished = chunk["text"], chunk["meta_info"]["finish_reason"] is not None
    assert finished, f"request {i}: stream ended without a finish reason"
    return None if chat else text


async def grpc_one(stub: tokenizer_pb2_grpc.TokenizerServiceStub, i: int, leave_after: int | None) -> str | None:
    n = SHORT if leave_after is None else LONG
    call = stub.Generate(grpc_request(i % PROMPTS, n, ignore_eos=leave_after is not None), timeout=120)
    if leave_after == -1:
        await asyncio.sleep(random.uniform(0, 0.05))
        call.cancel()
        return None
    text, k = "", 0
    async for response in call:
        if leave_after is not None and k >= leave_after:
            call.cancel()
            return None
        text += response.text
        k += 1
        if response.finished:
            return text
    raise AssertionError(f"gRPC request {i} ended without a finished response")


def test_1000_streams_with_random_disconnects_leak_nothing(frontend: System) -> None:
    url = frontend.http_url
    rng = random.Random(12)
    plan = []  # (i, transport, leave_after)
    for i in range(N_REQUESTS):
        transport = "grpc" if i < N_GRPC else rng.choice(["native", "native", "chat"])
        leave_after = None if rng.random() < 0.3 else rng.choice([-1, 0, *range(1, 9)])
        plan.append((i, transport, leave_after))
    rng.shuffle(plan)

    async def run() -> None:
        addrs = [t.address for t in frontend.by_component("tokenizer")]
        channels = [grpc.aio.insecure_channel(a) for a in addrs]
        stubs = [tokenizer_pb2_grpc.TokenizerServiceStub(ch) for ch in channels]
        limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            golden = [await native_once(c, url, native_body(p, SHORT, False)) for p in range(PROMPTS)]
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(i: int, transport: str, leave_after: int | None) -> tuple[int, str | None]:
                async with gate:
                    if transport == "grpc":
                        return i, await grpc_one(stubs[i % len(stubs)], i, leave_after)
                    return i, await http_one(c, url, i, leave_after, transport == "chat")

            results = await asyncio.wait_for(asyncio.gather(*(one(*p) for p in plan)), 600)
            for i, text in results:
                if text is not None:
                    assert text == golden[i % PROMPTS].text, (i, text)
            assert sum(t is not None for _, t in results) > N_REQUESTS // 5
        for ch in channels:
            await ch.close()

        wait_idle(frontend, timeout=30)
        async with httpx.AsyncClient(timeout=120) as c:
            again = await native_once(c, url, native_body(0, SHORT, False))
        assert again.text == golden[0].text

    asyncio.run(run())
