"""`within`: await something for at most a given time, without losing a cancellation.

`asyncio.wait_for` in Python <= 3.11 swallows a cancellation of the awaiting task that arrives
in the same loop iteration as the awaited result: it returns the result and the task runs on
as if never cancelled (python/cpython#86296). A Generate stream whose token arrived just as its
caller cancelled it then ran to max_tokens, holding its KV. Every bounded wait of the services
goes through `within` instead:
- on 3.11+ it is `asyncio.timeout` (which tells its own expiry from a cancel from outside);
- on 3.10 a timer cancels the task and only that cancel becomes TimeoutError.

`WaitBound` bounds each of a stream's repeated waits (one per output token) the same way with
one timer for the stream instead of one per wait.

Invariant: a cancel from outside always propagates as CancelledError; the deadline passing
raises asyncio.TimeoutError (on 3.11+ the builtin TimeoutError, the same class).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """The result of `aw`, or asyncio.TimeoutError once `timeout_s` seconds have passed (`aw` is
    then cancelled); a cancel of the calling task is never turned into a result."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await aw
    return await _within_310(aw, timeout_s)  # pragma: no cover (3.10)


async def _within_310(aw: Awaitable[T], timeout_s: float) -> T:  # pragma: no cover (3.10)
    task = asyncio.current_task()
    assert task is not None, "within() runs in a task"
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(timeout_s, 0.0), expire)
    try:
        return await aw
    except asyncio.CancelledError:
        if expired:
            raise asyncio.TimeoutError from None
        raise
    finally:
        timer.cancel()


class WaitBound:
    """`await bound.wait(aw)` is `within(aw, timeout_s)` for a wait that one task repeats, one
    at a time (a stream's next event, its next socket write): a single timer, armed for the
    earliest moment the pending wait (or, between waits, the next one) could pass its bound and
    re-armed from there, instead of a timer-heap entry and a Timeout per wait (~4 us each on
    3.11, once per output token per stream). `close` disarms it.

    Invariants: a wait that completes (or is renewed) within timeout_s of its start (or last
    renewal) is never cancelled by the bound; one that does not raises asyncio.TimeoutError; a
    cancel from outside propagates."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: float | None = None  # loop time the pending wait began; None between waits
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None

    def renew(self) -> None:
        """The pending wait counts from now: what it waits for made progress another way (a
        request's deltas delivered without passing through the awaited queue). No-op between
        waits."""
        if self._since is not None and self._loop is not None:
            self._since = self._loop.time()

    async def wait(self, aw: Awaitable[T]) -> T:
        loop = self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._since = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._since + self.timeout_s, self._check)
        try:
            return await aw
        except asyncio.CancelledError:
            if not self._expired:
                raise
            self._expired = False
            if sys.version_info >= (3, 11) and self._task is not None:
                self._task.uncancel()  # the bound's cancel, not the caller's
            raise asyncio.TimeoutError from None
        finally:
            self._since = None

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        since, now = self._since, loop.time()
        if since is not None and now - since >= self.timeout_s and self._task is not None:
            self._expired, self._timer = True, None
            self._task.cancel()
            return
        self._timer = loop.call_at((since if since is not None else now) + self.timeout_s, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
