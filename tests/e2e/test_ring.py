"""The ring end to end: golden tokens through REST, the public gRPC API (Generate, and
GenerateStream carrying a batch of requests with one engine step's responses per message),
cancellation freeing KV, and one trace per request across all four services."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import grpc

from meshlm.launch.launcher import System
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from .conftest import http_json, wait_idle
from .otlp_receiver import OtlpReceiver


def test_rest_greedy_equals_hf_golden(system: System, golden) -> None:
    body = {
        "input_ids": [g.input_ids for g in golden],
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
    }
    status, out = http_json(system.http_url + "/generate", body, timeout=180)
    assert status == 200, out
    assert [o["output_ids"] for o in out] == [g.output_ids for g in golden]
    wait_idle(system)


def test_grpc_generate_streams_tokens(system: System) -> None:
    async def run() -> list[tokenizer_pb2.GenerateResponse]:
        async with grpc.aio.insecure_channel(system.grpc_address) as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            req = tokenizer_pb2.GenerateRequest(
                prompts=[
                    tokenizer_pb2.Prompt(
                        messages=tokenizer_pb2.ChatMessages(
                            messages=[tokenizer_pb2.ChatMessage(role="user", content="Count from 1 to 10.")]
                        )
                    )
                ],
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=24),
                stream=True,
            )
            return [r async for r in stub.Generate(req, timeout=120)]

    responses = asyncio.run(run())
    assert len(responses) > 3
    assert responses[-1].finished
    assert responses[-1].meta_info.finish_reason.type in (common_pb2.FINISH_TYPE_STOP, common_pb2.FINISH_TYPE_LENGTH)
    assert sum(len(r.output_ids) for r in responses) == responses[-1].meta_info.completion_tokens
    assert "1" in "".join(r.text for r in responses)


def test_grpc_generate_stream_batches_a_step_of_many_requests(system: System) -> None:
    """Eight greedy requests over one GenerateStream call: each stream's text equals its own
    Generate call's, each ends once with code 0, and the responses of one engine step travel
    together (fewer messages than responses; messages carrying several streams)."""
    prompts = [f"Count from {i} to {i + 20}:" for i in range(8)]

    def request(p: str) -> tokenizer_pb2.GenerateRequest:
        sp = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        return tokenizer_pb2.GenerateRequest(prompts=[tokenizer_pb2.Prompt(text=p)], sampling_params=sp, stream=True)

    async def run() -> tuple[list[str], list[tokenizer_pb2.GenerateStreamResponse]]:
        async with grpc.aio.insecure_channel(system.grpc_address) as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            alone = []
            for p in prompts:
                alone.append("".join([r.text async for r in stub.Generate(request(p), timeout=120)]))

            async def requests():
                for sid, p in enumerate(prompts, 1):
                    yield tokenizer_pb2.GenerateStreamRequest(stream_id=sid, generate=request(p))

            messages = [m async for m in stub.GenerateStream(requests(), timeout=120)]
            return alone, messages

    alone, messages = asyncio.run(run())
    items = [i for m in messages for i in m.items]
    texts = ["".join(i.response.text for i in items if i.stream_id == sid) for sid in range(1, 9)]
    assert texts == alone
    ends = [(i.stream_id, i.end.code) for i in items if i.HasField("end")]
    assert sorted(ends) == [(sid, 0) for sid in range(1, 9)]
    responses = sum(i.HasField("response") for i in items)
    assert len(messages) < responses / 2
    assert sum(len({i.stream_id for i in m.items}) >= 4 for m in messages) >= 10
    wait_idle(system)


def test_client_disconnect_frees_kv_within_2s(system: System) -> None:
    body = json.dumps(
        {
            "text": "Tell me a very long story about the sea.",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(system.http_url + "/generate", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    resp = urllib.request.urlopen(req, timeout=60)  # noqa: S310 (loopback)
    lines = 0
    while lines < 5:
        if resp.readline().startswith(b"data:"):
            lines += 1
    deadline = time.monotonic() + 3.0  # loads are reported every 0.5 s while busy
    running = 0
    while running != 1 and time.monotonic() < deadline:
        _, info = http_json(system.http_url + "/get_server_info")
        running = sum(s["num_running_reqs"] for s in info["schedulers"])
        time.sleep(0.05)
    assert running == 1
    resp.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    wait_idle(system, timeout=2.0)
    assert time.monotonic() - t0 <= 2.0


def test_one_trace_per_request_across_services(system: System, otlp: OtlpReceiver) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 4}}).encode()
    req = urllib.request.Request(system.http_url + "/generate", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310
        assert r.status == 200
    deadline = time.monotonic() + 10
    services: set[str] = set()
    while time.monotonic() < deadline:
        services = {s.service for s in otlp.snapshot() if s.trace_id == trace_id}
        if {"meshlm-gateway", "meshlm-tokenizer", "meshlm-scheduler", "meshlm-detokenizer"} <= services:
            break
        time.sleep(0.2)
    assert {"meshlm-gateway", "meshlm-tokenizer", "meshlm-scheduler", "meshlm-detokenizer"} <= services, services


def _mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return {line.split()[-1].rsplit("/", 1)[-1] for line in f if "/" in line}


def test_torch_free_services_load_no_torch_and_no_openmp(system: System) -> None:
    """The scheduler's torch pool owns the cores: the gateway, tokenizer and detokenizer never
    load torch or an OpenMP runtime (whose spinning threads would compete with it)."""
    for component in ("gateway", "tokenizer", "detokenizer"):
        for child in system.by_component(component):
            assert child.proc is not None and child.proc.poll() is None
            libs = _mapped_libraries(child.proc.pid)
            heavy = {lib for lib in libs if lib.startswith(("libtorch", "libgomp", "libiomp", "libomp"))}
            assert not heavy, f"{child.name} maps {sorted(heavy)}"
    scheduler = system.by_component("scheduler")[0]
    assert scheduler.proc is not None
    assert any(lib.startswith("libtorch") for lib in _mapped_libraries(scheduler.proc.pid))
