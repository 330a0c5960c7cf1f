"""Clients and process handling of the front-end fault tests (issue 12: gateway / tokenizer /
detokenizer kills, client disconnects, slow clients).

Every stream is classified by how it ended, so that a test can require "its output or a clear
error" and catch the forbidden endings: a hang (each helper has a deadline), a truncated stream
(no finish reason, no error event) or an HTTP 200 whose JSON body holds an error."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import psutil

from meshlm.launch.launcher import Child, System, wait_ready
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

STREAM_DEADLINE_S = 120.0  # an affected stream must end (output or error) within this


def prompt(i: int) -> str:
    return f"Request {i}: repeat the number {i} three times."


def native_body(i: int, max_new_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, **extra.pop("sampling", {})}
    return {"text": prompt(i), "sampling_params": sampling, "stream": stream, **extra}


@dataclass
class Ending:
    """How one request ended: exactly one of text (its whole output, finished), error (an HTTP
    error status or an SSE error event) and dropped (the connection broke: only a dead gateway)."""

    text: str | None = None
    error: str | None = None
    dropped: str | None = None
    chunks: int = 0

    @property
    def ok(self) -> bool:
        return self.text is not None


async def native_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], started: asyncio.Event | None = None
) -> Ending:
    """POST /generate with stream=True and read it to the end, classifying the ending (`started` is
    set at its first chunk). A stream that ends without a finish reason and without an error event
    fails the test (truncated)."""

    async def read() -> Ending:
        text, finished, chunks = "", False, 0
        try:
            async with client.stream("POST", url + "/generate", json=body) as r:
                if r.status_code != 200:
                    return Ending(error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if line == "data: [DONE]":
                        assert finished, f"stream ended with [DONE] but no finish reason after {chunks} chunks"
                        return Ending(text=text, chunks=chunks)
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        return Ending(error=str(chunk["error"]), chunks=chunks)
                    chunks += 1
                    if started is not None:
                        started.set()
                    text = chunk["text"]  # native streaming is cumulative
                    finished = chunk["meta_info"]["finish_reason"] is not None
        except (httpx.TransportError, httpx.StreamError) as e:
            return Ending(dropped=f"{type(e).__name__}: {e}", chunks=chunks)
        raise AssertionError(f"stream closed without [DONE] after {chunks} chunks (finished={finished})")

    return await asyncio.wait_for(read(), STREAM_DEADLINE_S)


async def native_once(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Ending:
    """POST /generate (not streaming): 200 with the output, or an HTTP error; never 200 + error."""
    try:
        r = await asyncio.wait_for(client.post(url + "/generate", json=body), STREAM_DEADLINE_S)
    except (httpx.TransportError, httpx.StreamError) as e:
        return Ending(dropped=f"{type(e).__name__}: {e}")
    payload = r.json()
    if r.status_code != 200:
        return Ending(error=f"HTTP {r.status_code}: {payload}")
    assert "error" not in payload, f"HTTP 200 with an error inside: {payload}"
    return Ending(text=payload["text"])


def grpc_request(i: int, max_new_tokens: int, **sampling: Any) -> tokenizer_pb2.GenerateRequest:
    return tokenizer_pb2.GenerateRequest(
        prompts=[tokenizer_pb2.Prompt(text=prompt(i))],
        stream=True,
        sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=max_new_tokens, **sampling),
    )


async def grpc_stream(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
    request: tokenizer_pb2.GenerateRequest,
    started: asyncio.Event | None = None,
) -> Ending:
    """A public-API Generate stream read to its end: the output, or the gRPC status as the error."""

    async def read() -> Ending:
        text, chunks = "", 0
        call = stub.Generate(request, timeout=STREAM_DEADLINE_S)
        try:
            async for response in call:
                text += response.text
                chunks += 1
                if started is not None:
                    started.set()
                if response.finished:
                    return Ending(text=text, chunks=chunks)
        except grpc.aio.AioRpcError as e:
            return Ending(error=f"{e.code().name}: {e.details()}", chunks=chunks)
        raise AssertionError(f"gRPC stream ended without a finished response after {chunks} responses")

    return await asyncio.wait_for(read(), STREAM_DEADLINE_S)


async def all_started(events: list[asyncio.Event], timeout_s: float = STREAM_DEADLINE_S) -> None:
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout_s)


def wait_idle_at(url: str, timeout_s: float) -> dict[str, Any]:
    """Poll `url`/get_server_info until every scheduler runs nothing and holds no KV tokens."""
    deadline = time.monotonic() + timeout_s
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            info = httpx.get(url + "/get_server_info", timeout=30).json()
        except httpx.HTTPError as e:
            info = {"error": str(e)}
        scheds = info.get("schedulers") or []
        if scheds and all(s["num_running_reqs"] == 0 and s["num_used_tokens"] == 0 for s in scheds):
            return info
        time.sleep(0.2)
    raise AssertionError(f"schedulers not idle within {timeout_s}s: {info.get('schedulers', info)}")


# ---------------------------------------------------------------------------- processes


def kill(child: Child) -> None:
    assert child.proc is not None and child.proc.poll() is None, f"{child.name} is not running"
    child.proc.kill()  # SIGKILL
    child.proc.wait(timeout=30)


def restart(child: Child, timeout_s: float = 180.0) -> None:
    """Start the component again with the very argv it had (nothing else restarts)."""
    assert child.proc is None or child.proc.poll() is not None, f"{child.name} still runs"
    child.proc = subprocess.Popen(child.argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_ready(child, timeout_s)


def second_gateway(system: System, port: int, extra_args: tuple[str, ...] = ()) -> Child:
    """Another gateway replica on `port`, pointed at the same tokenizers as the launched one (what a
    second pod behind the load balancer is); the caller stops it."""
    first = system.by_component("gateway")[0]
    argv = list(first.argv)
    argv[argv.index("--port") + 1] = str(port)
    host = argv[argv.index("--host") + 1]
    child = Child(f"gateway-{port}", "gateway", f"{host}:{port}", argv + list(extra_args))
    restart(child)
    return child


def stop(child: Child) -> None:
    if child.proc is not None and child.proc.poll() is None:
        child.proc.terminate()
        try:
            child.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def rss_mib(child: Child) -> float:
    assert child.proc is not None
    return psutil.Process(child.proc.pid).memory_info().rss / (1 << 20)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample `name` in an exposition text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
