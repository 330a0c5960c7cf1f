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
from collections.abc import Callable, Iterable, Sequence

import grpc

from meshlm.common import addresses
from meshlm.common.addresses import Resolver
from meshlm.common.channels import Dialer
from meshlm.common.deadline import within
from meshlm.common.peer_stream import PeerStream
from meshlm.common.tls import TlsConfig
from meshlm.scheduler.service.tracker import RequestTracker
from meshlm.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2

logger = logging.getLogger(__name__)

UnavailableCallback = Callable[[list[str]], None]


class State(enum.Enum):
    DOWN = "down"  # no stream: outputs are not queued, affected requests are timed
    UP = "up"  # hello and resync sent: outputs are queued and written in order


class DetokenizerPushClient(PeerStream):
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
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        """tls: the Push channels use TLS (mTLS with a CA) when enabled; an endpoint resolved
        from a DNS name is verified against that name. token: the ring's internal token, sent
        on every Push."""
        dialer = Dialer(tls, resolver, token=token)
        super().__init__(scheduler_id, "detokenizer", dialer, connect_timeout_s=connect_timeout_s)
        self.scheduler_id = scheduler_id
        self.addrs = list(addrs)
        self.tracker = tracker
        self.on_unavailable = on_unavailable
        self.fail_after_s = fail_after_s
        self.write_timeout_s = write_timeout_s
        self.current: str | None = None  # the detokenizer of the last stream that came up
        self.down_since: float | None = time.monotonic()
        self.failovers = 0
        self._queue: asyncio.Queue[detokenizer_pb2.DetokenizerInput] = asyncio.Queue()
        self._pending: dict[str, float] = {}  # rid -> when its output became undeliverable
        self._index = zlib.crc32(scheduler_id.encode())  # spread schedulers over detokenizers
        self._watchdog_task: asyncio.Task[None] | None = None
        self._written = 0  # messages written on the current stream, hello included

    @property
    def state(self) -> State:
        return State.UP if self.connected else State.DOWN

    # ---- producer side ------------------------------------------------------------------
    def send(self, msg: detokenizer_pb2.DetokenizerInput, rids: Iterable[str]) -> None:
        """Queue one step's output (never blocks). While DOWN the message is dropped: the
        tracker holds the state the next resync sends, and the rids start their deadline."""
        if self.connected:
            self._queue.put_nowait(msg)
            return
        now = time.monotonic()
        for rid in rids:
            self._pending.setdefault(rid, now)

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        super().start()
        self._watchdog_task = asyncio.create_task(self._watchdog(), name="detok-watchdog")

    async def flush(self, timeout: float) -> bool:
        """Wait until every queued message has been written (True) or timeout (False)."""
        try:
            await within(self._queue.join(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self, timeout: float = 5.0) -> None:
        """End the stream cleanly and stop: every queued message is written, the stream is
        half-closed and the detokenizer's PushSummary awaited (it has read them all); after
        timeout the stream is cancelled instead."""
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        await super().close(grace_s=timeout)

    # ---- the stream ---------------------------------------------------------------------
    async def next_endpoint(self) -> str | None:
        """Fail-over: each dial takes the next endpoint of the re-resolved list."""
        candidates = await self.dialer.resolve(self.addrs)
        if not candidates:
            return None
        endpoint = candidates[self._index % len(candidates)]
        self._index += 1  # next time, another detokenizer
        return endpoint

    async def serve(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        """One Push stream: hello and resync, then the queued outputs in order."""
        call = detokenizer_pb2_grpc.DetokenizerServiceStub(channel).Push()
        try:
            # Everything queued so far is covered by the resync snapshot taken right now (no
            # await in between); outputs produced from here on are queued behind it.
            self._discard_queue()
            snapshot = self.tracker.resync(self.scheduler_id)
            first = [detokenizer_pb2.DetokenizerInput(hello=self.hello())]
            for m in snapshot:
                if isinstance(m, scheduler_pb2.BatchTokenIDOut):
                    first.append(detokenizer_pb2.DetokenizerInput(tokens=m))
                else:
                    first.append(detokenizer_pb2.DetokenizerInput(embeddings=m))
            if self.current is not None and self.current != endpoint:
                self.failovers += 1
            self.current = endpoint
            self.mark_up()
            self._written = 0
            for m in first:
                await within(call.write(m), self.write_timeout_s)
                self._written += 1
            self._pending.clear()  # everything they were waiting for has been re-sent
            self.down_since = None
            if snapshot:
                logger.info("detokenizer %s: resynced %d requests", endpoint, self.tracker.num_emitted())
            await self._write_queue(call)
        except asyncio.CancelledError:
            if self.connected:
                try:  # clean end of stream on close()
                    await within(call.done_writing(), 1.0)
                    await within(call, 1.0)
                except BaseException:
                    pass
            raise
        finally:
            call.cancel()

    async def _write_queue(self, call: grpc.aio.StreamUnaryCall) -> None:
        """Write queued messages in order until the stream breaks (raises) or close() is called
        (then the rest of the queue is written and the stream ended cleanly)."""
        ended = asyncio.ensure_future(self._call_done(call))
        closing = asyncio.ensure_future(self.wait_closing())
        try:
            while True:
                if closing.done() and self._queue.empty():
                    return await self._end_stream(call)
                get = asyncio.ensure_future(self._queue.get())
                waits = {get, ended} if closing.done() else {get, ended, closing}
                try:
                    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not get.done():
                        get.cancel()
                if get not in done:
                    if ended in done:
                        raise ConnectionError(f"Push stream ended: {ended.result()}")
                    continue  # closing: write what is left, then end the stream
                msg = get.result()
                try:
                    await within(call.write(msg), self.write_timeout_s)
                    self._written += 1
                finally:
                    self._queue.task_done()
        finally:
            ended.cancel()
            closing.cancel()

    async def _end_stream(self, call: grpc.aio.StreamUnaryCall) -> None:
        """Half-close and wait for the PushSummary: the count of messages the detokenizer read."""
        await within(call.done_writing(), self.write_timeout_s)
        summary = await within(call, self.write_timeout_s)
        if summary.messages != self._written:
            logger.warning(
                "detokenizer %s read %d of the %d messages of its Push stream",
                self.address,
                summary.messages,
                self._written,
            )

    @staticmethod
    async def _call_done(call: grpc.aio.StreamUnaryCall) -> str:
        try:
            await call
            return "closed by the detokenizer"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    def _discard_queue(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            self._queue.task_done()

    def on_down(self, reason: str, was_up: bool) -> None:
        if self.closed:
            logger.info("detokenizer %s stream closed", self.address)
        elif was_up:
            logger.warning("detokenizer %s stream lost (%s); failing over", self.address, reason)
            now = time.monotonic()
            self.down_since = now
            # Whatever the lost stream carried may not have been delivered.
            for t in self.tracker.emitted():
                self._pending.setdefault(t.rid, now)
        self._discard_queue()

    async def _watchdog(self) -> None:
        """Fail requests whose outputs had no detokenizer for fail_after_s."""
        while True:
            await asyncio.sleep(min(0.5, self.fail_after_s / 4))
            if self.connected or not self._pending:
                continue
            now = time.monotonic()
            expired = [rid for rid, t0 in self._pending.items() if now - t0 >= self.fail_after_s]
            for rid in expired:
                del self._pending[rid]
            expired = [rid for rid in expired if self.tracker.get(rid) is not None]
            if expired:
                logger.error(
                    "no detokenizer reachable for %.0fs (%s): failing %d requests",
                    self.fail_after_s,
                    ",".join(self.addrs),
                    len(expired),
                )
                self.on_unavailable(expired)
