"""SIGKILL of a front-end component under load (issue 12 part 3): a gateway replica and a
tokenizer replica. Each test checks that every affected request ends within a deadline with its
output or a clear error (a dead gateway can only drop its connections; a dead tokenizer's streams
end with an error event / UNAVAILABLE), that the other requests are untouched (their greedy
outputs equal the ones computed before the kill), that the scheduler frees every KV token (long
ignore_eos requests would hold theirs far past the idle deadline if their abort were lost), that
new requests succeed, and that the component restarted with the same argv rejoins on its own.
(The detokenizer kill is tests/e2e/test_scale.py::test_killing_a_detokenizer_under_load.)"""

from __future__ import annotations

import asyncio

import grpc
import httpx

from meshlm.launch.launcher import Child, System
from meshlm.v1 import tokenizer_pb2_grpc

from .clients import (
    STREAM_DEADLINE_S,
    all_started,
    grpc_request,
    grpc_stream,
    kill,
    native_body,
    native_once,
    native_stream,
    restart,
    wait_idle_at,
)
from .conftest import url_of

LONG = 1500  # tokens a victim would generate (ignore_eos) if nothing aborted it
IDLE_DEADLINE_S = 20.0  # far less than LONG decode steps take on this machine


def long_body(i: int) -> dict:
    return native_body(i, LONG, True, sampling={"ignore_eos": True})


def test_killing_a_gateway_replica_under_load(frontend: System, second: Child) -> None:
    victim = frontend.by_component("gateway")[0]
    url_a, url_b = frontend.http_url, url_of(second)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=STREAM_DEADLINE_S) as c:
            expected = await asyncio.gather(*(native_once(c, url_b, native_body(i, 32, False)) for i in range(8)))
            assert all(e.ok for e in expected), expected
            started = [asyncio.Event() for _ in range(6)]
            victims = [asyncio.create_task(native_stream(c, url_a, long_body(100 + i), started[i])) for i in range(6)]
            others = [asyncio.create_task(native_stream(c, url_b, native_body(i, 32, True))) for i in range(8)]
            await all_started(started)
            kill(victim)
            ends = await asyncio.gather(*victims)
            assert all(e.dropped for e in ends), ends  # the only ending a dead process can give
            got = await asyncio.gather(*others)
            assert [e.text for e in got] == [e.text for e in expected]

    asyncio.run(run())
    # The tokenizers saw the dead gateway's calls cancelled and aborted them at the scheduler.
    wait_idle_at(url_b, IDLE_DEADLINE_S)
    restart(victim)

    async def after() -> None:
        async with httpx.AsyncClient(timeout=STREAM_DEADLINE_S) as c:
            again = await asyncio.gather(*(native_once(c, url_a, native_body(i, 32, False)) for i in range(4)))
            before = await asyncio.gather(*(native_once(c, url_b, native_body(i, 32, False)) for i in range(4)))
        assert [e.text for e in again] == [e.text for e in before] and all(e.ok for e in again)

    asyncio.run(after())


def test_killing_a_tokenizer_replica_under_load(frontend: System) -> None:
    victim, survivor = frontend.by_component("tokenizer")
    url = frontend.http_url

    async def run() -> tuple[list, list]:
        async with (
            httpx.AsyncClient(timeout=STREAM_DEADLINE_S) as c,
            grpc.aio.insecure_channel(victim.address) as ch_v,
            grpc.aio.insecure_channel(survivor.address) as ch_s,
        ):
            stub_v = tokenizer_pb2_grpc.TokenizerServiceStub(ch_v)
            stub_s = tokenizer_pb2_grpc.TokenizerServiceStub(ch_s)
            expected = await asyncio.gather(*(grpc_stream(stub_s, grpc_request(i, 32)) for i in range(8)))
            expected_gw = await asyncio.gather(*(native_once(c, url, native_body(50 + i, 48, False)) for i in range(6)))
            assert all(e.ok for e in expected + expected_gw)
            started = [asyncio.Event() for _ in range(4)]
            direct = [
                asyncio.create_task(grpc_stream(stub_v, grpc_request(100 + i, LONG, ignore_eos=True), started[i]))
                for i in range(4)
            ]
            # Through the gateway: round robin over both replicas; those on the victim end with an
            # error event, the others with their output.
            via_gw = [asyncio.create_task(native_stream(c, url, native_body(50 + i, 48, True))) for i in range(6)]
            others = [asyncio.create_task(grpc_stream(stub_s, grpc_request(i, 32))) for i in range(8)]
            await all_started(started)
            kill(victim)
            ends = await asyncio.gather(*direct)
            assert all(e.error and "UNAVAILABLE" in e.error for e in ends), ends
            for exp, end in zip(expected_gw, await asyncio.gather(*via_gw), strict=True):
                assert end.text == exp.text or end.error, end
            got = await asyncio.gather(*others)
            assert [e.text for e in got] == [e.text for e in expected]
        return [e.text for e in expected], [e.text for e in expected_gw]

    golden, golden_gw = asyncio.run(run())
    # The scheduler aborted every request of the dead replica's origin when its Connect broke.
    wait_idle_at(url, IDLE_DEADLINE_S)
    restart(victim)  # SERVING again: its scheduler stream and detokenizer subscription are up

    async def after() -> None:
        async with grpc.aio.insecure_channel(victim.address) as ch, httpx.AsyncClient(timeout=STREAM_DEADLINE_S) as c:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            again = await asyncio.gather(*(grpc_stream(stub, grpc_request(i, 32)) for i in range(4)))
            via_gw = await asyncio.gather(*(native_once(c, url, native_body(50 + i, 48, False)) for i in range(6)))
        assert [e.text for e in again] == golden[:4]
        assert [e.text for e in via_gw] == golden_gw

    asyncio.run(after())
