"""SSEResponse's stall bound (issue 12 part 5) at the ASGI level: a client whose socket accepts
nothing (the server's `send` never returns) ends the stream after stream_stall_timeout_s, with its
on_close run (which cancels the gRPC call) and the stall counted; a client that reads gets the
whole body. The end-to-end form is tests/e2e/frontend/test_slow_client.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from meshlm.gateway.app import GatewayMetrics
from meshlm.gateway.config import GatewayConfig
from meshlm.gateway.outputs import sse_response


def scope_of(stall_s: float, metrics: GatewayMetrics) -> dict[str, Any]:
    config = GatewayConfig(tokenizer_addrs=("127.0.0.1:1",), stream_stall_timeout_s=stall_s)
    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(config=config), metrics=metrics))
    return {"type": "http", "asgi": {"spec_version": "2.3"}, "app": app, "client": ("10.0.0.1", 5)}


async def body(n: int) -> AsyncIterator[str]:
    for i in range(n):
        yield f"data: {i}\n\n"


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def stalled_count(metrics: GatewayMetrics) -> float:
    return metrics.metrics.registry.get_sample_value("meshlm:stalled_streams_total") or 0.0


def test_a_client_that_accepts_nothing_is_dropped_after_the_stall_timeout():
    metrics = GatewayMetrics()
    closed: list[bool] = []
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and len(sent) >= 3:
            await asyncio.Event().wait()  # the socket's buffers are full: never writable again
        sent.append(message)

    async def run() -> None:
        response = sse_response(body(1000), on_close=lambda: closed.append(True))
        await asyncio.wait_for(response(scope_of(0.2, metrics), never_disconnects, send), 10)

    asyncio.run(run())
    assert closed == [True]
    assert stalled_count(metrics) == 1
    assert sent[0]["type"] == "http.response.start" and len(sent) == 3


@pytest.mark.parametrize(
    ("delay_s", "stall_s", "events"),
    [
        (0.0, 0.2, 50),
        # the bound is per send, not per stream: every send takes 0.06 s (under the bound) and
        # the stream ~1.2 s, well past it, yet completes (one timer serves the whole stream)
        (0.06, 0.15, 20),
    ],
)
def test_a_client_that_reads_gets_the_whole_stream(delay_s: float, stall_s: float, events: int) -> None:
    metrics = GatewayMetrics()
    closed: list[bool] = []
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(delay_s)
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    async def run() -> None:
        response = sse_response(body(events), on_close=lambda: closed.append(True))
        await asyncio.wait_for(response(scope_of(stall_s, metrics), never_disconnects, send), 10)

    asyncio.run(run())
    assert b"".join(chunks).count(b"data: ") == events
    assert closed == [True] and stalled_count(metrics) == 0


def test_a_cancel_from_outside_during_a_pending_send_is_not_a_stall():
    """Cancelling the response (the server shutting down) while a send is blocked propagates as
    a cancellation, is not counted as a stall, and still runs on_close."""
    metrics = GatewayMetrics()
    closed: list[bool] = []

    async def run() -> None:
        started = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                started.set()
                await asyncio.Event().wait()

        response = sse_response(body(10), on_close=lambda: closed.append(True))
        task = asyncio.ensure_future(response(scope_of(5.0, metrics), never_disconnects, send))
        await started.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("the response finished instead of being cancelled")

    asyncio.run(run())
    assert closed == [True] and stalled_count(metrics) == 0
