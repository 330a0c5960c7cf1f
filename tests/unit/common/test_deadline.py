"""meshlm.common.deadline.within and WaitBound: bounded waits that never lose a cancellation.

The case that matters: the awaited result arrives in the same loop iteration as a cancel of the
waiting task. Python 3.11's asyncio.wait_for returns the result then and the task runs on; a
tokenizer's Generate stream cancelled just as a token arrived kept decoding to max_tokens (the
flaky test_client_disconnect_frees_kv_on_both_schedulers). The same race is run against
InFlight.next_event, the wait that lost it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from meshlm.common.deadline import WaitBound, within
from meshlm.common.errors import ServiceError
from meshlm.tokenizer.inflight import InFlight
from meshlm.tokenizer.metrics import TokenizerMetrics
from meshlm.tokenizer.state import ErrorEvent, ReqState


async def _cancel_as_the_result_arrives(
    wait: Callable[[], Awaitable[object]], deliver: Callable[[], None]
) -> tuple[list[object], bool]:
    """A task loops on `wait()`; one result is delivered and the task cancelled in the same
    iteration. Returns what the task got and whether it ended cancelled."""
    got: list[object] = []

    async def worker() -> None:
        while True:
            got.append(await wait())

    task = asyncio.create_task(worker())
    await asyncio.sleep(0)  # the worker waits
    deliver()
    await asyncio.sleep(0)  # the inner wait is done; the worker has not resumed yet
    task.cancel()
    await asyncio.sleep(0.05)
    ended_cancelled = task.done() and task.cancelled()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return got, ended_cancelled


def test_a_cancel_in_the_iteration_of_the_result_is_not_lost() -> None:
    async def run() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        _, cancelled = await _cancel_as_the_result_arrives(lambda: within(q.get(), 10), lambda: q.put_nowait(1))
        assert cancelled, "the task ran on after its cancel"

    asyncio.run(run())


def test_the_result_is_returned_and_the_deadline_raises_timeout() -> None:
    async def run() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        q.put_nowait(7)
        assert await within(q.get(), 1.0) == 7
        inner = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await within(inner, 0.05)
        assert inner.cancelled(), "the awaited work is cancelled at the deadline"

    asyncio.run(run())


def test_a_deadline_inside_cleanup_after_a_cancel_still_times_out() -> None:
    """detok_client ends its stream within a bound from an `except CancelledError` block."""

    async def run() -> str:
        async def worker() -> str:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                try:
                    await within(asyncio.sleep(10), 0.05)
                except asyncio.TimeoutError:
                    return "timed out"
            return "not cancelled"

        task = asyncio.create_task(worker())
        await asyncio.sleep(0)
        task.cancel()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(run()) == "timed out"


def test_wait_bound_keeps_a_cancel_that_races_the_result() -> None:
    async def run() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        bound = WaitBound(10)
        _, cancelled = await _cancel_as_the_result_arrives(lambda: bound.wait(q.get()), lambda: q.put_nowait(1))
        bound.close()
        assert cancelled, "the task ran on after its cancel"

    asyncio.run(run())


def test_wait_bound_bounds_each_wait_not_the_stream() -> None:
    """Waits of 0.03 s each under a 0.1 s bound, 1 s in all: none times out. Then one that hangs
    times out after ~0.1 s (its work cancelled), and the bound serves the next wait again."""

    async def run() -> None:
        bound = WaitBound(0.1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(33):
            await bound.wait(asyncio.sleep(0.03))
        assert loop.time() - start > 0.9
        inner = asyncio.ensure_future(asyncio.sleep(10))
        t0 = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await bound.wait(inner)
        assert 0.09 <= loop.time() - t0 < 0.5 and inner.cancelled()
        assert await bound.wait(asyncio.sleep(0.01, result=5)) == 5
        with pytest.raises(asyncio.TimeoutError):
            await bound.wait(asyncio.sleep(10))
        bound.close()

    asyncio.run(run())


def test_wait_bound_renewed_by_progress_elsewhere_does_not_expire() -> None:
    """One wait of 0.5 s under a 0.1 s bound, renewed every 0.03 s (a request's deltas delivered
    past its queue), completes; once the renewals stop it times out ~0.1 s after the last."""

    async def run() -> None:
        bound = WaitBound(0.1)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        async def progress(until: float) -> None:
            while loop.time() < until:
                await asyncio.sleep(0.03)
                bound.renew()

        t0 = loop.time()
        renewer = asyncio.ensure_future(progress(t0 + 0.5))
        loop.call_later(0.5, done.set)
        await bound.wait(done.wait())
        assert loop.time() - t0 >= 0.5
        await renewer
        t1 = loop.time()
        renewer = asyncio.ensure_future(progress(t1 + 0.3))
        with pytest.raises(asyncio.TimeoutError):
            await bound.wait(asyncio.sleep(10))
        assert 0.35 <= loop.time() - t1 < 1.0
        await renewer
        bound.renew()  # between waits: nothing to renew
        bound.close()

    asyncio.run(run())


def test_inflight_next_event_keeps_a_cancel_that_races_an_event() -> None:
    async def run() -> None:
        inflight = InFlight(TokenizerMetrics(), request_timeout_s=10)
        call = inflight.open_call("r")
        state = ReqState(call, 0, "r", req=None, conn=None)
        got, cancelled = await _cancel_as_the_result_arrives(
            lambda: inflight.next_event(call),
            lambda: call.queue.put_nowait(ErrorEvent(state, ServiceError(grpc.StatusCode.UNAVAILABLE, "gone"))),
        )
        assert len(got) == 1 and cancelled, "the Generate stream's task ran on after its cancel"

    asyncio.run(run())


def test_no_service_waits_with_asyncio_wait_for() -> None:
    """Every bounded wait of the services goes through `within` (see the module docstring)."""
    root = Path(__file__).resolve().parents[3] / "services"
    users = [str(p.relative_to(root)) for p in root.rglob("*.py") if "asyncio.wait_for(" in p.read_text()]
    assert not users, f"asyncio.wait_for in {users}: use meshlm.common.deadline.within"
