"""Per-output accumulation of GenerateResponse messages, finish reasons, and SSE framing.

The tokenizer streams deltas (text, ids, logprobs) per output `index` (= prompt_index * n + j), or
one whole message per output when not streaming; `Output.add` handles both the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi.responses import StreamingResponse

from meshlm.common.deadline import WaitBound
from meshlm.common.finish import FinishKind, FinishReason
from meshlm.gateway.errors import APIError, error_body
from meshlm.gateway.sse_direct import SERVER_SEND, DirectSend
from meshlm.v1 import common_pb2, tokenizer_pb2

logger = logging.getLogger(__name__)

LOGPROB_FIELDS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)


def abort_error(finish: FinishReason) -> APIError:
    return APIError(finish.http_status, finish.message or "the request was aborted")


def response_finish(response: tokenizer_pb2.GenerateResponse | None) -> FinishReason | None:
    """The finish reason of a response (None while its output runs)."""
    if response is None or not response.finished:
        return None
    return FinishReason.from_proto(response.meta_info.finish_reason)


def first_abort(response: tokenizer_pb2.GenerateResponse | None) -> FinishReason | None:
    """The ABORT a stream's first response ends with, if it does."""
    finish = response_finish(response)
    return finish if finish is not None and finish.is_abort else None


class Output:
    """Everything received so far for one output index.

    The text is kept as the deltas received (joined when `text` is read, then kept joined):
    appending to one string a delta at a time copies the whole text every time, quadratic in
    the output's length (~84 ms of copying for a 32k-token stream)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = ""
        self._text_parts: list[str] = []
        self.output_ids: list[int] = []
        self.finished = False
        self.finish: FinishReason | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.retractions = 0
        self.e2e_latency = 0.0
        self.messages = 0
        self.logprobs: dict[str, list[Any]] = {name: [] for name in LOGPROB_FIELDS}

    def add(self, response: tokenizer_pb2.GenerateResponse) -> None:
        meta = response.meta_info
        self.messages += 1
        if response.text:
            self._text_parts.append(response.text)
        self.output_ids.extend(response.output_ids)
        self.id = meta.id or self.id
        self.prompt_tokens = meta.prompt_tokens or self.prompt_tokens
        self.completion_tokens = meta.completion_tokens or max(self.completion_tokens, len(self.output_ids))
        self.cached_tokens = meta.cached_tokens or self.cached_tokens
        self.retractions = meta.retractions or self.retractions
        self.e2e_latency = meta.e2e_latency or self.e2e_latency
        if meta.HasField("logprobs"):
            for name in LOGPROB_FIELDS:
                self.logprobs[name].extend(getattr(meta.logprobs, name))
        if response.finished:
            self.finished = True
            self.finish = response_finish(response)

    @property
    def text(self) -> str:
        """The text of every delta so far, in order."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def abort(self) -> FinishReason | None:
        """The ABORT the output ended with, if it did."""
        return self.finish if self.finish is not None and self.finish.is_abort else None

    def openai_finish_reason(self) -> Literal["stop", "length"] | None:
        """stop | length (None while running; an abort is an error, not a finish reason)."""
        if not self.finished or self.finish is None:
            return None
        return "length" if self.finish.kind is FinishKind.LENGTH else "stop"

    def matched_stop(self) -> int | str | None:
        return self.finish.matched if self.finish is not None else None

    def sglang_finish_reason(self) -> dict[str, Any] | None:
        """SGLang's finish_reason dict (FinishReason.to_json); None while running."""
        if not self.finished or self.finish is None:
            return None
        return self.finish.to_json()


def input_logprob_values(entries: list[common_pb2.TokenLogprob]) -> list[float | None]:
    """Prompt logprobs; the first prompt token has none (SGLang's None)."""
    flagged = any(e.has_logprob for e in entries)
    return [
        (e.logprob if e.has_logprob else None) if flagged else (None if i == 0 else e.logprob)
        for i, e in enumerate(entries)
    ]


# The JSON of every SSE event (compact, UTF-8 as is); openai_outputs' chunk formatters share it.
# One encoder for the process: json.dumps with any non-default argument builds a JSONEncoder per
# call (~1.4-2.7 us, three times an output token in a chunk); its encode() is the same text.
json_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: Any) -> str:
    return "data: " + json_compact(obj) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message))


class StreamStalled(Exception):
    """The client accepted nothing for stream_stall_timeout_s (it does not read its stream)."""


def _stalled(exc: BaseException) -> bool:
    """exc is StreamStalled, or a group (a task group's) holding only that."""
    if isinstance(exc, StreamStalled):
        return True
    group = getattr(exc, "exceptions", None)  # BaseExceptionGroup (a builtin from 3.11)
    return isinstance(group, tuple) and bool(group) and all(_stalled(e) for e in group)


class StallWatch:
    """An SSE stream's `send` with the stall bound: a send still pending stall_s after it began
    raises StreamStalled (one WaitBound a stream, not a timeout per send, as a stream sends one
    event per output token). `close` disarms it."""

    def __init__(self, send: Any, stall_s: float) -> None:
        self._send = send
        self.stall_s = stall_s
        self._bound = WaitBound(stall_s)

    async def __call__(self, message: Any) -> None:
        await self.wait(self._send(message))

    async def wait(self, send: Awaitable[None]) -> None:
        """Await a send (made here or started elsewhere) under the stall bound."""
        try:
            await self._bound.wait(send)
        except asyncio.TimeoutError:
            raise StreamStalled(f"the client accepted nothing for stream_stall_timeout_s={self.stall_s:g}s") from None

    def close(self) -> None:
        self._bound.close()


class SSEResponse(StreamingResponse):
    """An SSE stream that runs `on_close` however the response ends (finished, client gone, server
    shutting down, stalled), even if the body never started, so the gRPC call behind it is always
    cancelled.

    Bounded per stream: the body is produced only as fast as the client takes it (uvicorn pauses a
    send while its 64 KiB write buffer is full, and the gRPC call is read no faster than that). A
    send that waits longer than the gateway's stream_stall_timeout_s (the client does not read) ends
    the stream: the call is cancelled (the tokenizer aborts the request and its KV is freed), the
    stall is logged and counted (meshlm:stalled_streams_total) and uvicorn closes the connection.

    With `direct`, the body iterator may also have events sent from outside its task
    (sse_direct.DirectSend): it is bound here to this response's send once the response runs,
    and closed with it."""

    def __init__(
        self,
        body: AsyncIterator[str],
        on_close: Callable[[], None] | None = None,
        direct: DirectSend | None = None,
    ) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close
        self.direct = direct

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        app_state = getattr(scope.get("app"), "state", None)
        gateway = getattr(app_state, "gateway", None)
        stall_s: float | None = gateway.config.stream_stall_timeout_s if gateway is not None else None
        watch = StallWatch(send, stall_s) if stall_s is not None else None
        if self.direct is not None:  # its body chunks go to the server's send, past the middlewares
            self.direct.bind(scope.get(SERVER_SEND, send), watch.wait if watch is not None else None)

        try:
            await super().__call__(scope, receive, watch if watch is not None else send)
        except BaseException as e:
            if not _stalled(e):
                raise
            client = scope.get("client") or ("?", 0)
            logger.warning("SSE client %s:%s stalled: %s; request aborted, closing", client[0], client[1], e)
            metrics = getattr(app_state, "metrics", None)
            if metrics is not None:
                metrics.stalled_streams.inc()
        finally:
            if self.direct is not None:
                self.direct.close()
            if watch is not None:
                watch.close()
            if self.on_close is not None:
                self.on_close()


def sse_response(
    body: AsyncIterator[str], on_close: Callable[[], None] | None = None, direct: DirectSend | None = None
) -> SSEResponse:
    return SSEResponse(body, on_close, direct)
