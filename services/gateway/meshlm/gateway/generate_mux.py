"""The gateway's Generate calls multiplexed over one TokenizerService.GenerateStream call per
tokenizer endpoint (protos/meshlm/v1/tokenizer.proto; the tokenizer's side is
meshlm.tokenizer.generate_stream).

With a Generate call per request, each response of each request is a gRPC message (~60 us of
grpc.aio on each side); over GenerateStream the tokenizer sends one engine step's responses of
all requests as one message, and this module hands each to its request's MuxStream.

Invariants:
- A MuxStream behaves as grpc_client.CallStream does for a Generate call: `first` is its
  first response (None when it ended without one), iterating yields the responses in order and
  ends at its StreamEnd (OK) or raises ServiceError with the StreamEnd's status, and cancel()
  (idempotent) cancels it at the tokenizer (its requests are aborted) and drops what it holds.
- Every stream ends: with its own StreamEnd, with the call's failure (UNAVAILABLE, naming the
  tokenizer; a tokenizer without GenerateStream gives UNIMPLEMENTED and the pool falls back to
  Generate), at its deadline (DEADLINE_EXCEEDED, cancelled at the tokenizer), or past
  MAX_BACKLOG_BYTES of responses its reader has not taken (RESOURCE_EXHAUSTED, cancelled: an
  SSE client that does not read cannot make the gateway buffer without bound).
- A call that fails is replaced by a new one at the next open(); its streams never move.
- set_direct: a response with nothing queued before it may be taken by the stream's consumer
  in the reader itself (openai_streams.choice_events); what it declines, and every end, is
  queued: the consumer sees each response once, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc

from meshlm.common.errors import ServiceError
from meshlm.v1 import tokenizer_pb2, tokenizer_pb2_grpc

logger = logging.getLogger(__name__)

# Undelivered bytes a stream may hold (the tokenizer's --max-stream-backlog-bytes default).
MAX_BACKLOG_BYTES = 4 << 20


def status_error(code: grpc.StatusCode, message: str, address: str) -> ServiceError:
    """The ServiceError of a tokenizer call's status: the message (else the code's name), the
    tokenizer's address in front on UNAVAILABLE and DEADLINE_EXCEEDED."""
    message = message or code.name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and address:
        message = f"tokenizer {address}: {message}"
    return ServiceError(code, message)


_CODES = {c.value[0]: c for c in grpc.StatusCode}
# Failures of the call that its streams keep as they are (anything else is UNAVAILABLE to them).
KEPT_CALL_CODES = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class GenerateStream:
    """A started Generate whose first response (if any) has arrived, as its reader sees it:
    `first`, the responses in order by iteration (which cancels the stream when the reader
    stops), and cancel(). A subclass says how the next response is read: grpc_client.CallStream
    (a Generate call of its own) or MuxStream (one stream of a GenerateStream call)."""

    first: tokenizer_pb2.GenerateResponse | None
    address: str

    async def next_response(self) -> tokenizer_pb2.GenerateResponse | None:
        """The next response after `first`; None at the end; ServiceError on failure."""
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def set_direct(self, deliver: Callable[[tokenizer_pb2.GenerateResponse], bool] | None) -> bool:
        """Hand the responses that arrive from now on to `deliver` as they arrive, in the
        receiving code, instead of queueing them for next_response (None: queue them again);
        False where the stream cannot (a Generate call of its own is read only by its reader)."""
        return False

    async def __aiter__(self) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        try:
            if self.first is not None:
                first, self.first = self.first, None
                yield first
            while (response := await self.next_response()) is not None:
                yield response
        finally:
            self.cancel()


class MuxStream(GenerateStream):
    """One Generate over a GenerateStream call (see the module docstring)."""

    def __init__(self, call: _MuxCall, stream_id: int, deadline: float) -> None:
        self._call = call
        self.stream_id = stream_id
        self.address = call.address
        self.first: tokenizer_pb2.GenerateResponse | None = None
        # (response, its size) in order; the end last: None (OK) or the ServiceError
        self._items: deque[tuple[tokenizer_pb2.GenerateResponse, int] | ServiceError | None] = deque()
        self._bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # an end (of any kind) was received or decided here
        # set_direct's deliver: takes a response (True) or declines it (False: it is queued)
        self._direct: Callable[[tokenizer_pb2.GenerateResponse], bool] | None = None
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(deadline - time.monotonic(), 0.0), self._expire)

    # ---- fed by the call's reader -------------------------------------------------------------
    def feed(self, item: tokenizer_pb2.GenerateStreamItem) -> None:
        if self._ended:
            return
        if item.HasField("end"):
            code = _CODES.get(item.end.code, grpc.StatusCode.UNKNOWN)
            self._finish(None if code == grpc.StatusCode.OK else status_error(code, item.end.message, self.address))
            return
        if self._direct is not None and not self._items and self._direct(item.response):
            return  # nothing queued before it: order holds
        size = item.response.ByteSize()
        self._items.append((item.response, size))
        self._bytes += size
        if self._bytes > MAX_BACKLOG_BYTES:
            message = (
                f"the client did not read its stream ({self._bytes} bytes undelivered, at most"
                f" {MAX_BACKLOG_BYTES}); request aborted"
            )
            self.cancel(ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
            return
        self._wake()

    def fail(self, error: ServiceError) -> None:
        """The call failed: the stream ends with `error` (unless it had ended)."""
        if not self._ended:
            self._finish(error)

    # ---- the consumer's side --------------------------------------------------------------
    def set_direct(self, deliver: Callable[[tokenizer_pb2.GenerateResponse], bool] | None) -> bool:
        """See GenerateStream.set_direct: `deliver` runs in the call's reader, for a response
        with nothing queued before it; what it declines, and every end, is queued as before.
        The backlog bound counts queued responses only (a delivered one is the deliverer's)."""
        self._direct = deliver if not self._ended else None
        return True

    async def take_first(self) -> None:
        """Wait for the first item: sets `first`, or raises the error the stream ended with."""
        self.first = await self.next_response()  # None: it ended without a response

    async def next_response(self) -> tokenizer_pb2.GenerateResponse | None:
        item = await self._next()
        if isinstance(item, ServiceError):
            raise item
        return item

    def cancel(self, error: ServiceError | None = None) -> None:
        """Cancel the stream at the tokenizer if it still runs and drop what it holds; a reader
        then gets `error` (default: the stream just ends)."""
        if self._ended:
            return
        self._call.send_cancel(self.stream_id)
        self.first = None
        self._items.clear()
        self._bytes = 0
        self._finish(error)

    # ---- internals --------------------------------------------------------------------------
    async def _next(self) -> tokenizer_pb2.GenerateResponse | ServiceError | None:
        """The next response, or the end (None: OK; it stays, so every later read sees it)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items[0]
        if isinstance(item, tuple):
            self._items.popleft()
            self._bytes -= item[1]
            return item[0]
        return item

    def _finish(self, error: ServiceError | None) -> None:
        self._ended = True
        self._direct = None
        self._timer.cancel()
        self._call.forget(self.stream_id)
        self._items.append(error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _expire(self) -> None:
        self.cancel(status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", self.address))


class _MuxCall:
    """One GenerateStream call and the streams it carries."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerServiceStub, address: str) -> None:
        self.address = address
        self.streams: dict[int, MuxStream] = {}
        self.alive = True
        self._next_id = 1
        self._outgoing: asyncio.Queue[tokenizer_pb2.GenerateStreamRequest | None] = asyncio.Queue()
        self._opened = asyncio.Event()  # the tokenizer sent its initial metadata: it serves the method
        self._call = stub.GenerateStream(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"generate-mux-{address}")

    def open(self, request: tokenizer_pb2.GenerateRequest, deadline: float) -> MuxStream:
        stream_id, self._next_id = self._next_id, self._next_id + 1
        stream = MuxStream(self, stream_id, deadline)
        self.streams[stream_id] = stream
        self._outgoing.put_nowait(tokenizer_pb2.GenerateStreamRequest(stream_id=stream_id, generate=request))
        return stream

    def send_cancel(self, stream_id: int) -> None:
        if self.alive and stream_id in self.streams:
            self._outgoing.put_nowait(tokenizer_pb2.GenerateStreamRequest(stream_id=stream_id, cancel=True))

    def forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    async def _requests(self) -> AsyncIterator[tokenizer_pb2.GenerateStreamRequest]:
        # Nothing is written before the tokenizer has answered the call: a write racing the
        # refusal of a server without the method ends the call with INTERNAL instead of
        # UNIMPLEMENTED (and the pool would not know to fall back to Generate).
        await self._opened.wait()
        while (msg := await self._outgoing.get()) is not None:
            yield msg

    async def _read(self) -> None:
        error = status_error(grpc.StatusCode.UNAVAILABLE, "the GenerateStream call ended", self.address)
        try:
            await self._call.initial_metadata()  # GenerateStreamCall sends it at once; a refusal ends the call
            self._opened.set()
            async for response in self._call:
                for item in response.items:
                    stream = self.streams.get(item.stream_id)
                    if stream is not None:
                        stream.feed(item)
        except grpc.aio.AioRpcError as e:
            # The call is every stream's link to the tokenizer: its failure is UNAVAILABLE to
            # them, except what the call itself was refused for (an older tokenizer, auth).
            code = e.code() if e.code() in KEPT_CALL_CODES else grpc.StatusCode.UNAVAILABLE
            error = status_error(code, e.details() or e.code().name, self.address)
        except asyncio.CancelledError:
            error = status_error(grpc.StatusCode.UNAVAILABLE, "the gateway is closing", self.address)
            raise
        finally:
            self.alive = False
            for stream in list(self.streams.values()):
                stream.fail(error)
            self.streams.clear()

    def close(self) -> None:
        self.alive = False
        self._outgoing.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()


class GenerateMux:
    """The GenerateStream call to one tokenizer endpoint, made on first use and again after it
    fails."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerServiceStub, address: str) -> None:
        self.stub = stub
        self.address = address
        self._call: _MuxCall | None = None

    async def generate(self, request: tokenizer_pb2.GenerateRequest, deadline: float) -> MuxStream:
        """Start `request` and wait for its first response; raises the ServiceError it ends with
        before any (UNIMPLEMENTED: this tokenizer has no GenerateStream)."""
        if self._call is None or not self._call.alive:
            self._call = _MuxCall(self.stub, self.address)
        stream = self._call.open(request, deadline)
        try:
            await stream.take_first()
        except BaseException:
            stream.cancel()
            raise
        return stream

    def close(self) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None
