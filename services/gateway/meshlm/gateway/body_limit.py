"""BodyLimitMiddleware: HTTP request bodies of at most `max_bytes` (--max-request-bytes).

A body over the limit is a 413 in OpenAI's error shape: at once when its Content-Length says so
(nothing is read), else as soon as the bytes read pass the limit (a chunked body). Pure ASGI, so
streaming responses and client-disconnect detection are untouched. Invariant: no route reads
more than max_bytes of body, so a client cannot make the gateway buffer more.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.gateway.errors import error_response


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the limit. A starlette HTTPException, so
    FastAPI's body parsing lets it through (it turns other exceptions into a bare 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"request body is larger than {limit} bytes (the gateway's --max-request-bytes)"


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            await error_response(413, too_large_message(limit))(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await error_response(413, too_large_message(limit))(scope, receive, send)
