"""`within`: await something for at most a given time, without losing a cancellation.

`asyncio.wait_for` in Python <= 3.11 swallows a cancellation of the awaiting task that arrives
in the same loop iteration as the awaited result: it returns the result and the task runs on
as if never cancelled (python/cpython#86296). A Generate stream whose token arrived just as its
caller cancelled it then ran to max_tokens, holding its KV. Every bounded wait of the services
goes through `within` instead:
- on 3.11+ it is `asyncio.timeout` (which tells its own expiry from a cancel from outside);
- on 3.10 a timer cancels the task and only that cancel becomes TimeoutError.

Invariant: a cancel from outside always propagates as CancelledError; the deadline passing
raises asyncio.TimeoutError (on 3.11+ the builtin TimeoutError, the same class).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

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
