"""Prefill/decode disaggregation end to end: gateway -> tokenizer -> prefill scheduler, which
hands KV + first token over gRPC to a decode scheduler that streams to the detokenizer.
Golden tokens and logprobs through REST, the openai client streaming, cancellation freeing KV
on both schedulers, and a decode scheduler dying mid-request ends it with a clear error."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from meshlm.common import protocol
from meshlm.launch.launcher import System
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc

from .conftest import http_json, start_system


@pytest.fixture(scope="module")
def pd_system(smollm_path: str) -> Iterator[System]:
    sys_ = start_system(smollm_path, decode_dp_size=1)
    yield sys_
    sys_.stop()


def scheduler_load(address: str):
    """The SchedulerLoad a scheduler sends first on a fresh Connect stream."""

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


def wait_both_idle(system: System, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    loads = []
    while time.monotonic() < deadline:
        loads = [scheduler_load(c.address) for c in system.by_component("scheduler")]
        if all(x.num_running_reqs == 0 and x.num_queue_reqs == 0 and x.num_used_tokens == 0 for x in loads):
            return
        time.sleep(0.1)
    raise AssertionError(f"schedulers not idle within {timeout}s: {loads}")


def decode_child(system: System):
    return next(c for c in system.by_component("scheduler") if c.name.startswith("decode-scheduler"))


def test_rest_greedy_and_logprobs_equal_hf_golden(pd_system: System, golden) -> None:
    body = {
        "input_ids": [g.input_ids for g in golden],
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
        "return_logprob": True,
    }
    status, out = http_json(pd_system.http_url + "/generate", body, timeout=180)
    assert status == 200, out
    assert [o["output_ids"] for o in out] == [g.output_ids for g in golden]
    for g, o in zip(golden, out):
        ours = [row[0] for row in o["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, g.logprobs)) < 1e-3
    wait_both_idle(pd_system)
    decode_load = scheduler_load(decode_child(pd_system).address)
    assert decode_load.max_total_num_tokens > 0


def test_openai_chat_stream(pd_system: System) -> None:
    import openai

    client = openai.OpenAI(base_url=pd_system.http_url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count from 1 to 5."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "1" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 1
    wait_both_idle(pd_system)


def _open_stream(system: System, max_new_tokens: int, events: int):
    """A streaming /generate, returned once `events` SSE data lines have arrived."""
    body = json.dumps(
        {
            "text": "Tell me a very long story about the sea.",
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(system.http_url + "/generate", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    resp = urllib.request.urlopen(req, timeout=60)  # noqa: S310 (loopback)
    lines = 0
    while lines < events:
        if resp.readline().startswith(b"data:"):
            lines += 1
    return resp


def test_client_disconnect_frees_kv_on_both_schedulers(pd_system: System) -> None:
    resp = _open_stream(pd_system, 2000, events=5)
    assert scheduler_load(decode_child(pd_system).address).num_running_reqs == 1
    resp.close()
    wait_both_idle(pd_system, timeout=3.0)


def test_decode_scheduler_death_ends_requests_with_an_error(pd_system: System) -> None:
    """Runs last: it kills the module's decode scheduler."""
    resp = _open_stream(pd_system, 5000, events=3)
    child = decode_child(pd_system)
    assert child.proc is not None
    child.proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    tail = b""
    while time.monotonic() - t0 < 15:
        line = resp.readline()
        if not line:
            break
        tail += line
    resp.close()
    assert b"decode scheduler" in tail and b"went away" in tail, tail[-500:]
    assert time.monotonic() - t0 < 15
    prefill = next(c for c in pd_system.by_component("scheduler") if c is not child)
    load = scheduler_load(prefill.address)
    assert load.num_running_reqs == 0 and load.num_used_tokens == 0
    status, out = http_json(pd_system.http_url + "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4}})
    assert status == 503 and "no decode scheduler reachable" in json.dumps(out), (status, out)
