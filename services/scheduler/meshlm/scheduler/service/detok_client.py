"""DetokenizerPushClient: the scheduler's one Push stream to a detokenizer, with fail-over.

    start -> pick an address (re-resolved each round) -> Push: hello (scheduler id and protocol
    version; a detokenizer of another version refuses the stream), resync, then
    one message per engine step -> the stream breaks -> next address -> hello, resync, ...

A resync re-sends every tracked request (tracker.resync: seed set, all output ids from
token offset 0, finish reason if finished; finished requests are kept 30 s), so a new
detokenizer can rebuild its state and the tokenizer drops what it already has.

While no detokenizer is reachable nothing is queued (the tracker holds the state a resync
sends); the requests with outputs produced meanwhile — and every request a detokenizer knew
when its stream broke — are failed through `on_unavailable` once `fail_after_s` passes.
Owned by the service's asyncio loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import zlib
from typing import Awaitable, Callable, Iterable, Optional, Sequence

import grpc
from meshlm.common import addresses, protocol
from meshlm.common.tls import PLAINTEXT, TlsConfig, aio_channel
from meshlm.scheduler.service.tracker import RequestTracker
from meshlm.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
Resolver = Callable[[str], Awaitable[list[str]]]
UnavailableCallback = Callable[[list[str]], None]


class State(enum.Enum):
    DOWN = "down"  # no stream: outputs are not queued, affected requests are timed
    UP = "up"  # hello and resync sent: outputs are queued and written in order


class DetokenizerPushClient:
    def __init__(
        self,
        scheduler_id: str,
        addrs: Sequence[str],
        tracker: RequestTracker,
        on_unavailable: UnavailableCallback,
        *,
        fail_after_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        write_timeout_s: float = 10.0,
        resolver: Resolver = addresses.resolve,
        tls: Optional[TlsConfig] = None,
    ) -> None:
        """tls: the Push channels use TLS (mTLS with a CA) when enabled; an endpoint resolved
        from a DNS name is verified against that name."""
        self.scheduler_id = scheduler_id
        self.addrs = list(addrs)
        self.tracker = tracker
        self.on_unavailable = on_unavailable
        self.fail_after_s = fail_after_s
        self.connect_timeout_s = connect_timeout_s
        self.write_timeout_s = write_timeout_s
        self._resolver = resolver
        self.tls = tls or PLAINTEXT
        self._names: dict[str, str] = {}  # endpoint -> the DNS name it was resolved from
        self.state = State.DOWN
        self.address: Optional[str] = None  # the detokenizer of the current stream
        self.down_since: Optional[float] = time.monotonic()
        self.failovers = 0
        self._queue: "asyncio.Queue[detokenizer_pb2.DetokenizerInput]" = asyncio.Queue()
        self._pending: dict[str, float] = {}  # rid -> when its output became undeliverable
        self._index = zlib.crc32(scheduler_id.encode())  # spread schedulers over detokenizers
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._up_event = asyncio.Event()

    # ---- producer side ------------------------------------------------------------------
    def send(self, msg: detokenizer_pb2.DetokenizerInput, rids: Iterable[str]) -> None:
        """Queue one step's output (never blocks). While DOWN the message is dropped: the
        tracker holds the state the next resync sends, and the rids start their deadline."""
        if self.state is State.UP:
            self._queue.put_nowait(msg)
            return
        now = time.monotonic()
        for rid in rids:
            self._pending.setdefault(rid, now)

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name="detok-push"),
            asyncio.create_task(self._watchdog(), name="detok-watchdog"),
        ]

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up_event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def flush(self, timeout: float) -> bool:
        """Wait until every queued message has been written (True) or timeout (False)."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self, timeout: float = 2.0) -> None:
        """Flush, end the stream cleanly (done_writing), stop."""
        if self.state is State.UP:
            await self.flush(timeout)
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []

    # ---- the stream ---------------------------------------------------------------------
    async def _candidates(self) -> list[str]:
        return await addresses.resolve_all(self.addrs, self._names, self._resolver)

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            try:
                candidates = await self._candidates()
            except Exception:
                logger.exception("cannot resolve detokenizer addresses %s", self.addrs)
                candidates = []
            if not candidates:
                await asyncio.sleep(1.0)
                continue
            addr = candidates[self._index % len(candidates)]
            served = await self._serve(addr)
            self._index += 1  # next time, another detokenizer
            if served:
                backoff = 0.05
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _serve(self, addr: str) -> bool:
        """Run one Push stream to addr until it breaks; True if it was ever up."""
        channel = aio_channel(addr, self.tls, CHANNEL_OPTIONS, self._names.get(addr))
        call = None
        was_up = False
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.connect_timeout_s)
            except (asyncio.TimeoutError, grpc.RpcError):
                logger.debug("detokenizer %s not reachable", addr)
                return False
            call = detokenizer_pb2_grpc.DetokenizerServiceStub(channel).Push()
            # Everything queued so far is covered by the resync snapshot taken right now (no
            # await in between); outputs produced from here on are queued behind it.
            self._discard_queue()
            snapshot = self.tracker.resync(self.scheduler_id)
            first = [detokenizer_pb2.DetokenizerInput(hello=protocol.hello(self.scheduler_id))]
            for m in snapshot:
                if isinstance(m, scheduler_pb2.BatchTokenIDOut):
                    first.append(detokenizer_pb2.DetokenizerInput(tokens=m))
                else:
                    first.append(detokenizer_pb2.DetokenizerInput(embeddings=m))
            self._set_up(addr)
            was_up = True
            for m in first:
                await asyncio.wait_for(call.write(m), self.write_timeout_s)
            self._pending.clear()  # everything they were waiting for has been re-sent
            self.down_since = None
            self._up_event.set()
            if snapshot:
                logger.info("detokenizer %s: resynced %d requests", addr, self.tracker.num_emitted())
            ended = asyncio.ensure_future(self._call_done(call))
            try:
                while True:
                    get = asyncio.ensure_future(self._queue.get())
                    try:
                        done, _ = await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        if not get.done():
                            get.cancel()
                    if get not in done:
                        raise ConnectionError(f"Push stream ended: {ended.result()}")
                    msg = get.result()
                    try:
                        await asyncio.wait_for(call.write(msg), self.write_timeout_s)
                    finally:
                        self._queue.task_done()
            finally:
                ended.cancel()
        except asyncio.CancelledError:
            if call is not None and self.state is State.UP:
                try:  # clean end of stream on close()
                    await asyncio.wait_for(call.done_writing(), 1.0)
                    await asyncio.wait_for(call, 1.0)
                except BaseException:
                    pass
            raise
        except Exception as e:
            if was_up:
                logger.warning("detokenizer %s stream failed (%s); failing over", addr, e)
            return was_up
        finally:
            self._set_down()
            if call is not None:
                call.cancel()
            await channel.close(grace=None)
        return was_up

    @staticmethod
    async def _call_done(call: grpc.aio.StreamUnaryCall) -> str:
        try:
            await call
            return "closed by the detokenizer"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]

    def _discard_queue(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            self._queue.task_done()

    def _set_up(self, addr: str) -> None:
        if self.address is not None and self.address != addr:
            self.failovers += 1
        self.state = State.UP
        self.address = addr

    def _set_down(self) -> None:
        if self.state is State.UP:
            now = time.monotonic()
            self.down_since = now
            # Whatever the lost stream carried may not have been delivered.
            for t in self.tracker.emitted():
                self._pending.setdefault(t.rid, now)
        self.state = State.DOWN
        self._up_event.clear()
        self._discard_queue()

    async def _watchdog(self) -> None:
        """Fail requests whose outputs had no detokenizer for fail_after_s."""
        while True:
            await asyncio.sleep(min(0.5, self.fail_after_s / 4))
            if self.state is State.UP or not self._pending:
                continue
            now = time.monotonic()
            expired = [rid for rid, t0 in self._pending.items() if now - t0 >= self.fail_after_s]
            for rid in expired:
                del self._pending[rid]
            expired = [rid for rid in expired if self.tracker.get(rid) is not None]
            if expired:
                logger.error(
                    "no detokenizer reachable for %.0fs (%s): failing %d requests",
                    self.fail_after_s, ",".join(self.addrs), len(expired),
                )
                self.on_unavailable(expired)
