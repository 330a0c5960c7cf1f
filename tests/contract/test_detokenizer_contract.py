"""DetokenizerService over real gRPC (loopback): Push from a scheduler, Subscribe per origin,
health, reflection, holding for late subscribers, drain, and the process's SIGTERM exit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.common import protocol
from meshlm.common.ports import free_port
from meshlm.detokenizer.config import DetokenizerConfig
from meshlm.detokenizer.decoder import TokenizerDecoder
from meshlm.detokenizer.service import SERVICE_NAME, RunningDetokenizer, start_detokenizer
from meshlm.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2

TEXTS = {
    "a": ("t1", "The quick brown fox jumps over the lazy dog."),
    "b": ("t2", "你好世界，今天天气很好"),
    "c": ("t1", "Waves 🌊🐚🏖️ and sand."),
    "d": ("t2", "Short one."),
}
LENGTH = common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH)


@pytest.fixture(scope="module")
def decoder(smollm_path: str) -> TokenizerDecoder:
    return TokenizerDecoder.from_path(smollm_path)


def run_with_server(
    decoder: TokenizerDecoder,
    scenario: Callable[[RunningDetokenizer, grpc.aio.Channel], Awaitable[None]],
    **cfg,
) -> None:
    async def main() -> None:
        config = DetokenizerConfig(tokenizer_path="unused", host="127.0.0.1", port=0, **cfg)
        running = await start_detokenizer(config, decoder=decoder)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                await asyncio.wait_for(scenario(running, channel), 30)
        finally:
            await running.stop(grace_s=2.0)

    asyncio.run(main())


def token_steps(decoder: TokenizerDecoder, rids: list[str]) -> list[scheduler_pb2.BatchTokenIDOut]:
    """One BatchTokenIDOut per step, one token per request per step (requests interleaved)."""
    ids = {rid: decoder.tokenizer.encode(TEXTS[rid][1], add_special_tokens=False).ids for rid in rids}
    steps = []
    for k in range(max(len(v) for v in ids.values())):
        b = scheduler_pb2.BatchTokenIDOut(scheduler_id="s0")
        for rid in rids:
            if k >= len(ids[rid]):
                continue
            d = b.deltas.add(
                rid=rid,
                origin=TEXTS[rid][0],
                output_ids=[ids[rid][k]],
                token_offset=k,
                completion_tokens=k + 1,
            )
            if k == 0:
                d.seed.CopyFrom(scheduler_pb2.DecodeSeed(skip_special_tokens=True, spaces_between_special_tokens=True))
            if k == len(ids[rid]) - 1:
                d.finish_reason.CopyFrom(LENGTH)
        steps.append(b)
    return steps


def embeddings() -> scheduler_pb2.BatchEmbeddingOut:
    e = scheduler_pb2.BatchEmbeddingOut(scheduler_id="s0")
    e.results.add(rid="e1", origin="t1", embedding=[0.25, -1.5], finish_reason=LENGTH)
    e.results.add(rid="e2", origin="t2", embedding=[3.0], finish_reason=LENGTH)
    return e


def subscribe(stub: detokenizer_pb2_grpc.DetokenizerServiceStub, origin: str):
    return stub.Subscribe(detokenizer_pb2.SubscribeRequest(hello=protocol.hello(origin)))


async def push(stub: detokenizer_pb2_grpc.DetokenizerServiceStub, msgs: list) -> int:
    async def gen() -> AsyncIterator[detokenizer_pb2.DetokenizerInput]:
        yield detokenizer_pb2.DetokenizerInput(hello=protocol.hello("s0"))
        for m in msgs:
            if isinstance(m, scheduler_pb2.BatchTokenIDOut):
                yield detokenizer_pb2.DetokenizerInput(tokens=m)
            else:
                yield detokenizer_pb2.DetokenizerInput(embeddings=m)

    summary = await stub.Push(gen())
    return summary.messages


async def collect(call, want_rids: set[str]) -> tuple[dict[str, str], dict[str, list[float]], set[str]]:
    """Read a Subscribe stream until every wanted rid finished; text by rid, embeddings, all rids."""
    texts: dict[str, str] = {}
    embs: dict[str, list[float]] = {}
    seen: set[str] = set()
    done: set[str] = set()
    async for out in call:
        if out.HasField("strs"):
            for d in out.strs.deltas:
                seen.add(d.rid)
                assert d.text_offset == len(texts.get(d.rid, ""))
                texts[d.rid] = texts.get(d.rid, "") + d.text
                if d.HasField("finish_reason"):
                    done.add(d.rid)
        else:
            for r in out.embeddings.results:
                seen.add(r.rid)
                embs[r.rid] = list(r.embedding)
                done.add(r.rid)
        if want_rids <= done:
            break
    return texts, embs, seen


def test_each_subscriber_gets_only_its_own_requests(decoder) -> None:
    async def scenario(running: RunningDetokenizer, channel: grpc.aio.Channel) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        sub1 = subscribe(stub, "t1")
        sub2 = subscribe(stub, "t2")
        steps = token_steps(decoder, ["a", "b", "c", "d"])
        assert await push(stub, [*steps, embeddings()]) == len(steps) + 2
        (t1, e1, seen1), (t2, e2, seen2) = await asyncio.gather(
            collect(sub1, {"a", "c", "e1"}), collect(sub2, {"b", "d", "e2"})
        )
        assert t1 == {"a": TEXTS["a"][1], "c": TEXTS["c"][1]} and seen1 == {"a", "c", "e1"}
        assert t2 == {"b": TEXTS["b"][1], "d": TEXTS["d"][1]} and seen2 == {"b", "d", "e2"}
        assert e1 == {"e1": [0.25, -1.5]} and e2 == {"e2": [3.0]}
        sub1.cancel()
        sub2.cancel()
        for _ in range(100):  # a cancelled Subscribe unregisters its origin
            if not running.manager.has_subscriber("t1") and not running.manager.has_subscriber("t2"):
                break
            await asyncio.sleep(0.02)
        assert not running.manager.has_subscriber("t1") and not running.manager.has_subscriber("t2")

    run_with_server(decoder, scenario)


def test_late_subscriber_gets_held_outputs_within_hold_time(decoder) -> None:
    async def scenario(running: RunningDetokenizer, channel: grpc.aio.Channel) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        expired = scheduler_pb2.BatchEmbeddingOut()
        expired.results.add(rid="old", origin="t2", embedding=[1.0])
        await push(stub, [expired])
        await asyncio.sleep(1.2)  # past the hold time: dropped
        await push(stub, token_steps(decoder, ["a", "b"]))
        await asyncio.sleep(0.2)  # within the hold time: kept
        texts1, _, _ = await collect(subscribe(stub, "t1"), {"a"})
        texts2, _, seen2 = await collect(subscribe(stub, "t2"), {"b"})
        assert texts1 == {"a": TEXTS["a"][1]} and texts2 == {"b": TEXTS["b"][1]}
        assert "old" not in seen2

    run_with_server(decoder, scenario, undelivered_hold_s=0.8)


def test_health_reflection_and_bad_subscribe(decoder) -> None:
    async def scenario(running: RunningDetokenizer, channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = set()
        async for resp in call:
            names |= {s.name for s in resp.list_services_response.service}
            break
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in subscribe(stub, ""):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run_with_server(decoder, scenario)


def test_a_peer_of_another_protocol_version_is_refused(decoder) -> None:
    """Push and Subscribe refuse a hello of another version, or none (a protocol-1 peer), with
    FAILED_PRECONDITION naming both versions."""
    newer = common_pb2.Hello(peer_id="x", protocol_version=protocol.PROTOCOL_VERSION + 1)

    async def refused(call) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        return err.value

    async def read_all(call) -> None:
        async for _ in call:
            pass

    async def scenario(running: RunningDetokenizer, channel: grpc.aio.Channel) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        pushes = [
            iter([detokenizer_pb2.DetokenizerInput(hello=newer)]),
            # A protocol-1 scheduler: `string hello_scheduler = 3`, unknown to this version.
            iter([detokenizer_pb2.DetokenizerInput.FromString(bytes([3 << 3 | 2, 2]) + b"s1")]),
        ]
        subscribes = [
            detokenizer_pb2.SubscribeRequest(hello=newer),
            # A protocol-1 tokenizer: `string origin = 1`.
            detokenizer_pb2.SubscribeRequest.FromString(bytes([1 << 3 | 2, 2]) + b"t1"),
        ]
        errors = [await refused(stub.Push(p)) for p in pushes]
        errors += [await refused(read_all(stub.Subscribe(r))) for r in subscribes]
        for e, theirs in zip(errors, [protocol.PROTOCOL_VERSION + 1, 1] * 2):
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
            assert f"speaks meshlm.v1 ring protocol {theirs}" in e.details()
            assert f"this detokenizer speaks {protocol.PROTOCOL_VERSION}" in e.details()
        assert not running.manager.has_subscriber("t1")

    run_with_server(decoder, scenario)


def test_drain_flushes_subscribers_and_ends_pushes(decoder) -> None:
    async def scenario(running: RunningDetokenizer, channel: grpc.aio.Channel) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        sub = subscribe(stub, "t1")
        pusher = stub.Push()
        await pusher.write(detokenizer_pb2.DetokenizerInput(hello=protocol.hello("s0")))
        for b in token_steps(decoder, ["a"]):
            await pusher.write(detokenizer_pb2.DetokenizerInput(tokens=b))
        marker = scheduler_pb2.BatchTokenIDOut()
        marker.deltas.add(rid="z", origin="t9", output_ids=[42])
        await pusher.write(detokenizer_pb2.DetokenizerInput(tokens=marker))
        for _ in range(200):  # every step before the marker has been decoded
            if running.manager.detokenizer.status("z") is not None:
                break
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await running.stop(grace_s=10.0)
        took = time.monotonic() - t0
        text = ""
        async for out in sub:  # ends cleanly after everything queued was sent
            text += "".join(d.text for d in out.strs.deltas)
        assert text == TEXTS["a"][1]
        assert await sub.code() == grpc.StatusCode.OK
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pusher
        # the open Push gets its status at once (it does not hold the server's stop to the grace)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (err.value.details() or "")
        assert took < 5

    run_with_server(decoder, scenario)


def test_process_serves_and_exits_0_on_sigterm(smollm_path: str) -> None:
    port = free_port()
    env = {**os.environ, "MESHLM_DETOKENIZER_TOKENIZER_PATH": smollm_path}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshlm.detokenizer",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--grace-period-s",
            "2",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    status = (
                        health_pb2_grpc.HealthStub(ch)
                        .Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1)
                        .status
                    )
                break
            except grpc.RpcError:
                time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
