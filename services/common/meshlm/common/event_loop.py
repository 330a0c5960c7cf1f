"""The asyncio event loop of meshlm's processes: uvloop where it is installed.

Every relay of the ring (tokenizer, detokenizer, gateway) and the scheduler's gRPC front are
asyncio programs whose CPU per streamed token is largely the event loop's own work: waking on a
socket, running the callbacks of one gRPC message or one SSE write. uvloop (libuv, in C) does
that work for less CPU than the standard library's selector loop, which is written in Python;
SGLang's tokenizer manager and uvicorn[standard] run on it too. uvloop is a dependency wherever
it has a build (not on Windows); the standard loop is the fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def loop_name() -> str:
    """'uvloop' or 'asyncio': the loop run() starts, in the spelling of uvicorn's `loop` setting."""
    return "uvloop" if has_uvloop() else "asyncio"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on a uvloop loop when uvloop is installed."""
    if has_uvloop():
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
