"""DetokenizerPushClient.close() ends its Push stream cleanly: what was queued reaches a slow
detokenizer in full (half-close, then its PushSummary), and a stalled one cannot hold the
shutdown past the timeout."""

from __future__ import annotations

import asyncio
import time

import grpc

from meshlm.scheduler.service.detok_client import DetokenizerPushClient
from meshlm.scheduler.service.tracker import RequestTracker
from meshlm.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2


class SlowDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    """Reads one message per `delay_s` (None: never reads past the hello)."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.received: list[detokenizer_pb2.DetokenizerInput] = []

    async def Push(self, request_iterator, context):  # noqa: N802 - the gRPC method name
        async for msg in request_iterator:
            self.received.append(msg)
            if self.delay_s is None:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
        return detokenizer_pb2.PushSummary(messages=len(self.received))


async def push_then_close(delay_s: float | None, n: int, timeout: float) -> tuple[SlowDetokenizer, float]:
    servicer = SlowDetokenizer(delay_s)
    server = grpc.aio.server()
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = DetokenizerPushClient("sched-close", [f"127.0.0.1:{port}"], RequestTracker(), lambda rids: None)
    try:
        client.start()
        assert await client.wait_up(10)
        for i in range(n):
            out = scheduler_pb2.BatchTokenIDOut(scheduler_id="sched-close")
            out.deltas.add(rid=f"r{i}", output_ids=[i])
            client.send(detokenizer_pb2.DetokenizerInput(tokens=out), [f"r{i}"])
        t0 = time.monotonic()
        await client.close(timeout=timeout)
        return servicer, time.monotonic() - t0
    finally:
        await server.stop(None)


def test_close_delivers_every_queued_message_to_a_slow_detokenizer() -> None:
    # 40 messages read at 25 ms each: a second of reading after the client has written them all
    servicer, _ = asyncio.run(push_then_close(0.025, 40, timeout=20))
    kinds = [m.WhichOneof("msg") for m in servicer.received]
    assert kinds == ["hello"] + ["tokens"] * 40
    assert [m.tokens.deltas[0].rid for m in servicer.received[1:]] == [f"r{i}" for i in range(40)]


def test_close_gives_up_on_a_stalled_detokenizer_after_its_timeout() -> None:
    servicer, took = asyncio.run(push_then_close(None, 5, timeout=0.5))
    assert len(servicer.received) == 1  # the hello; it never read on
    assert took < 5  # timeout, then at most the cancelled stream's own 1 s + 1 s clean-up
