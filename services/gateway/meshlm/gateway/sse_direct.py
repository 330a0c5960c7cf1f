"""An SSE stream's events written by the code that receives them (the GenerateStream call's
reader), not by a wake-up of the request's own task per event.

A streamed output token is one SSE event. Through the ASGI response's body iterator each event
costs the request's task a wake-up (a future, a task step, five generator frames and the stall
bound's bookkeeping); at 64 streams that is 64 task switches per engine step. The call's reader
already holds each step's responses, so it formats every stream's event and starts its ASGI
`send` itself: while the client reads, uvicorn writes the bytes to the socket at once and the
send is over before `write` returns.

Invariants (DirectSend):
- Events reach `send` in the order written, one send in flight at most.
- A send that would wait (the client's socket buffer is full) is finished by a task of its own;
  the stream is then `blocked`: what is written meanwhile is held, in order, and `resume` (in the
  response's task, under the stall bound) waits for that send and hands back what was held, to
  be sent after it. Nothing is sent behind a pending send's back.
- `close` cancels a send still in flight; `write` after it holds nothing and sends nothing.

The send it is given is the server's own where the app put it in the scope (SERVER_SEND): a body
chunk then skips the middlewares' send wrappers (six to eight coroutines an event), which act on
`http.response.start` alone (status for metrics and spans, CORS headers, "response started"
flags). The start message, and whatever the response's task sends, still pass through them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]
Bound = Callable[[Awaitable[None]], Awaitable[None]]

SERVER_SEND = "meshlm.server_send"
"""ASGI scope key: the server's own `send`, set by the app before any middleware sees the request
(app.GatewayApp)."""


async def _finish(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    """Run the rest of a coroutine whose first step, made by hand, yielded `waiting` (an
    asyncio future, or None for a bare yield): asyncio's Task step, for a coroutine it did not
    start."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            elif getattr(waiting, "_asyncio_future_blocking", None) is not None:
                # The first step left the future's "yielded by an await" flag set; the Task
                # step that receives a yielded future clears it, and so does this one.
                waiting._asyncio_future_blocking = False
                await waiting
            else:
                raise RuntimeError(f"a send yielded {waiting!r}, not an asyncio future")
        except BaseException as e:  # cancelled: the coroutine gets it where it waits
            try:
                waiting = coro.throw(e)
            except StopIteration:
                return
            continue
        try:
            waiting = coro.send(None)
        except StopIteration:
            return


class DirectSend:
    """The body sends of one SSE response, made synchronously by whoever calls `write` (see the
    module docstring). Usable once `bind` gave it the response's ASGI send."""

    def __init__(self) -> None:
        self._send: Send | None = None
        self._bound: Bound | None = None
        self._pending: asyncio.Future[None] | None = None
        self._held: list[str] = []
        self.blocked = False
        self.closed = False

    @property
    def ready(self) -> bool:
        """Bound, open and not blocked: a write goes straight to the socket."""
        return self._send is not None and not self.blocked and not self.closed

    def bind(self, send: Send, bound: Bound | None) -> None:
        """The response's ASGI send and the stall bound its own sends wait under (bound before
        the response starts; writes come only once its body has begun, after the start message)."""
        self._send, self._bound = send, bound

    def write(self, event: str) -> None:
        """Send one SSE event now; if the send would wait, finish it in a task and hold the
        events after it (blocked). Raises what the send raises."""
        if self.closed:
            return
        if self.blocked or self._send is None:
            self._held.append(event)
            self.blocked = True
            return
        coro = self._send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        try:
            waiting = coro.send(None)  # type: ignore[attr-defined]
        except StopIteration:
            return
        self.blocked = True
        self._pending = asyncio.ensure_future(_finish(coro, waiting))  # type: ignore[arg-type]

    async def resume(self) -> list[str]:
        """In the response's task: wait (under the stall bound) for the send in flight, unblock,
        and return the events held meanwhile, which the caller sends next, in order."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await (self._bound(pending) if self._bound is not None else pending)
        held, self._held = self._held, []
        self.blocked = False
        return held

    def close(self) -> None:
        self.closed = True
        self._held.clear()
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        self._pending = None
