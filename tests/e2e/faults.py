"""Helpers of the scheduler fault tests (a scheduler SIGKILLed under load): a scheduler's own load
report, waiting for schedulers to be idle with their KV free and for the tokenizer to reconnect,
one more tokenizer + gateway pair with other flags, and reading a native /generate SSE stream.
Killing and restarting a process with its argv: tests/e2e/frontend/clients.py (kill, restart)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from meshlm.common import protocol
from meshlm.launch.launcher import Child, System, free_port, wait_ready
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc


def scheduler_load(address: str) -> common_pb2.SchedulerLoad:
    """The SchedulerLoad a scheduler sends first on a fresh Connect stream (fresh from its loop)."""

    async def hello():  # keeps the stream open: ending it would end the scheduler's side too
        yield scheduler_pb2.SchedulerInput(hello=protocol.hello("test-probe"))
        await asyncio.sleep(30)

    async def run():
        async with grpc.aio.insecure_channel(address) as ch:
            call = scheduler_pb2_grpc.SchedulerServiceStub(ch).Connect(hello())
            async for out in call:
                if out.WhichOneof("msg") == "load":
                    call.cancel()
                    return out.load
        raise AssertionError(f"no load report from {address}")

    return asyncio.run(run())


def busy(load: common_pb2.SchedulerLoad) -> int:
    return load.num_running_reqs + load.num_queue_reqs


def wait_idle(children: list[Child], timeout: float = 30.0) -> None:
    """Until every child scheduler runs and queues nothing and holds no KV (cache aside)."""
    deadline = time.monotonic() + timeout
    loads: list[common_pb2.SchedulerLoad] = []
    while time.monotonic() < deadline:
        loads = [scheduler_load(c.address) for c in children]
        if all(busy(x) == 0 and x.num_used_tokens == 0 for x in loads):
            return
        time.sleep(0.1)
    raise AssertionError(f"schedulers not idle with their KV free within {timeout}s: {loads}")


def wait_schedulers_connected(system: System, timeout: float = 60.0) -> None:
    """Until the system's tokenizer (behind its gateway) has every scheduler stream up again."""
    deadline = time.monotonic() + timeout
    ends: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            info = httpx.get(system.http_url + "/get_server_info", timeout=10).json()
            ends = info["tokenizer_config"]["scheduler_endpoints"]
            if ends and all(e["connected"] for e in ends):
                return
        time.sleep(0.2)
    raise AssertionError(f"the tokenizer did not reconnect to every scheduler within {timeout}s: {ends}")


def _with(argv: list[str], **flags: str) -> list[str]:
    """argv with each --flag's value replaced (or the flag appended)."""
    out = list(argv)
    for name, value in flags.items():
        opt = "--" + name.replace("_", "-")
        if opt in out:
            out[out.index(opt) + 1] = value
        else:
            out += [opt, value]
    return out


def add_front_end(system: System, name: str, **tokenizer_flags: str) -> str:
    """One more tokenizer (tokenizer-0's argv with other flags) and a gateway in front of it, both
    stopped with the system; returns the gateway's URL."""
    h = system.plan.host
    base = system.by_component("tokenizer")[0]
    tok_addr, http_port = f"{h}:{free_port(h)}", free_port(h)
    tok_argv = _with(base.argv, port=tok_addr.rsplit(":", 1)[1], tokenizer_id=f"tokenizer-{name}", **tokenizer_flags)
    gw = system.by_component("gateway")[0]
    gw_argv = _with(gw.argv, port=str(http_port), tokenizer_addrs=tok_addr)
    for child in (
        Child(f"tokenizer-{name}", "tokenizer", tok_addr, tok_argv),
        Child(f"gateway-{name}", "gateway", f"{h}:{http_port}", gw_argv),
    ):
        child.proc = subprocess.Popen(child.argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        system.children.append(child)
        wait_ready(child, 120, system.plan.tls)
    return f"http://{h}:{http_port}"


@dataclass
class NativeStream:
    """A streaming native /generate read to its end: every data event (cumulative text), and
    whether the body ended with [DONE]."""

    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    status: int = 0

    @property
    def texts(self) -> list[str]:
        return [e["text"] for e in self.events if "text" in e]

    @property
    def error(self) -> dict[str, Any] | None:
        return next((e["error"] for e in self.events if "error" in e), None)


async def native_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], into: NativeStream) -> NativeStream:
    async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
        into.status = r.status_code
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                into.done = True
            elif line.startswith("data:"):
                into.events.append(json.loads(line[5:]))
    return into


def greedy_body(prompt: str, max_new_tokens: int) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}


async def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
