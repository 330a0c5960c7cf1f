"""GenerateStream: many Generate calls over one bidirectional stream (protos/meshlm/v1/tokenizer.proto).

A Generate call costs a gRPC message per response: at 64 streaming requests that is 64 messages
per engine step, each ~60 us of grpc.aio on this side and as much on the caller's. Here every
stream of the call runs `TokenizerManager.generate` as its own task, as a Generate call would,
with a sink: a streaming request's responses but the last are put in the call's outbox by the
callback that read the detokenizer's BatchStrOut, without waking the stream's task; the task
yields the last ones (and ends the stream). The call's writer sends whatever the outbox holds as
one GenerateStreamResponse, so one step's outputs of every stream leave in one message.

Invariants:
- Per stream id: its responses in order, then exactly one StreamEnd (code 0, or the status its
  Generate call would have ended with), unless the caller cancelled it (then nothing more: the
  sink drops what arrives for a stream that is cancelled or ended).
- A cancel, the caller ending the call, or the call failing cancels the stream's task, which
  aborts its requests at their schedulers (TokenizerManager.generate's cleanup).
- The outbox holds at most about `max_backlog_bytes` of responses: past it (the caller stopped
  reading the call, so the writer blocks on flow control) every stream is cancelled at once, so
  nothing more is produced, and the call ends with RESOURCE_EXHAUSTED, as a Generate caller that
  does not read gets it for its one call.
- When the tokenizer drains and no stream runs, the call ends (OK), so shutdown need not wait for
  the caller to close it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from meshlm.common.deadline import within
from meshlm.common.errors import ServiceError
from meshlm.tokenizer.grpc_status import status_of
from meshlm.v1 import tokenizer_pb2

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.5  # how often an idle call checks whether the tokenizer drains


class Generator(Protocol):
    """What a stream runs: TokenizerManager's generate (which may hand some responses to sink
    instead of yielding them, in order before the ones it yields) and draining flag."""

    draining: bool

    def generate(
        self, request: tokenizer_pb2.GenerateRequest, sink: Callable[[tokenizer_pb2.GenerateResponse], None]
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]: ...


def end_item(stream_id: int, code: grpc.StatusCode, message: str = "") -> tokenizer_pb2.GenerateStreamItem:
    return tokenizer_pb2.GenerateStreamItem(
        stream_id=stream_id, end=tokenizer_pb2.StreamEnd(code=code.value[0], message=message)
    )


class GenerateStreamCall:
    """The streams of one GenerateStream call (see the module docstring)."""

    def __init__(self, manager: Generator, max_backlog_bytes: int) -> None:
        self.manager = manager
        self.max_backlog_bytes = max_backlog_bytes
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._live: set[int] = set()  # streams whose responses may still be put (not cancelled or ended)
        self._outbox = tokenizer_pb2.GenerateStreamResponse()  # built in place, sent as it is
        self._outbox_bytes = 0
        self._wake = asyncio.Event()
        self._reading = True
        self._overflow: ServiceError | None = None

    async def run(
        self, requests: AsyncIterator[tokenizer_pb2.GenerateStreamRequest]
    ) -> AsyncIterator[tokenizer_pb2.GenerateStreamResponse]:
        """The call's responses; ends when the caller half-closed and every stream ended, or
        when the tokenizer drains with no stream running. Raises ServiceError on overflow."""
        reader = asyncio.create_task(self._read(requests), name="generate-stream-reader")
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(self._wake.wait(), DRAIN_POLL_S)
                self._wake.clear()
                if self._overflow is not None:
                    raise self._overflow
                if self._outbox.items:
                    msg, self._outbox, self._outbox_bytes = self._outbox, tokenizer_pb2.GenerateStreamResponse(), 0
                    yield msg
                if not self._tasks and not self._outbox.items and (not self._reading or self.manager.draining):
                    return
        finally:
            self._live.clear()
            reader.cancel()
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[tokenizer_pb2.GenerateStreamRequest]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("msg")
                if kind == "generate":
                    self._start(msg.stream_id, msg.generate)
                elif kind == "cancel":
                    task = self._tasks.get(msg.stream_id)
                    if task is not None:
                        self._live.discard(msg.stream_id)
                        task.cancel()
        finally:
            self._reading = False
            self._wake.set()

    def _start(self, stream_id: int, request: tokenizer_pb2.GenerateRequest) -> None:
        if stream_id in self._tasks:
            self._put(end_item(stream_id, grpc.StatusCode.INVALID_ARGUMENT, f"stream_id {stream_id} is running"))
            return
        self._live.add(stream_id)
        self._tasks[stream_id] = asyncio.create_task(self._one(stream_id, request), name=f"generate-stream-{stream_id}")

    async def _one(self, stream_id: int, request: tokenizer_pb2.GenerateRequest) -> None:
        def sink(response: tokenizer_pb2.GenerateResponse) -> None:
            if stream_id in self._live:
                self._put_response(stream_id, response)

        try:
            async with contextlib.aclosing(self.manager.generate(request, sink)) as outputs:  # type: ignore[type-var]
                async for response in outputs:
                    self._put_response(stream_id, response)
            self._put(end_item(stream_id, grpc.StatusCode.OK))
        except asyncio.CancelledError:
            pass  # cancelled by the caller or the call's end: nothing more for this id
        except Exception as e:
            self._put(end_item(stream_id, *status_of(e, "GenerateStream")))
        finally:
            self._live.discard(stream_id)
            self._tasks.pop(stream_id, None)
            self._wake.set()

    def _put_response(self, stream_id: int, response: tokenizer_pb2.GenerateResponse) -> None:
        item = self._outbox.items.add(stream_id=stream_id)
        item.response.CopyFrom(response)
        self._added(item)

    def _put(self, item: tokenizer_pb2.GenerateStreamItem) -> None:
        self._outbox.items.append(item)  # a copy
        self._added(self._outbox.items[-1])

    def _added(self, item: tokenizer_pb2.GenerateStreamItem) -> None:
        """Account for the item just added to the outbox; past max_backlog_bytes, overflow."""
        self._outbox_bytes += item.ByteSize()
        self._wake.set()
        if self._outbox_bytes > self.max_backlog_bytes and self._overflow is None:
            self._overflow = ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the caller did not read its GenerateStream ({self._outbox_bytes} bytes of output undelivered,"
                f" max_stream_backlog_bytes={self.max_backlog_bytes}); every stream aborted",
            )
            logger.warning("%s", self._overflow.message)
            self._live.clear()
            for task in self._tasks.values():
                task.cancel()
