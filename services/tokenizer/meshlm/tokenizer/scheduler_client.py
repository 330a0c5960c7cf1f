"""The tokenizer's side of SchedulerService.Connect: one long-lived bidi stream per scheduler.

Per stream (docs/ring.md "Tokenizer -> scheduler"): the first message is a `hello` (origin id
and protocol version; a scheduler of another version refuses the stream), then
a `get_load`; the stream counts as up once the scheduler's first reply arrives. Generate, embed
and abort messages are fire-and-forget; control messages carry a `call_id` and wait, under a
deadline, for the reply with the same id. A stream that ends, fails, or stays silent for
STALE_AFTER_S (the scheduler reports its load every ~0.5-2 s) is lost: pending control calls
fail with UNAVAILABLE, the events handler's `on_scheduler_lost` runs (the manager fails or
retries that scheduler's requests), and the client reconnects with backoff. Messages queued for a
lost stream are dropped: the scheduler already aborted that origin's requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from meshlm.common.channels import Dialer
from meshlm.common.deadline import within
from meshlm.common.errors import ServiceError
from meshlm.common.peer_stream import RESOLVE_INTERVAL_S, PeerSet, PeerStream
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

# A scheduler reports its load every ~0.5-2 s, but the report passes through its engine loop,
# which a long forward pass can hold up: only a long silence means a dead peer.
STALE_AFTER_S = 60.0


class SchedulerEvents(Protocol):
    def on_scheduler_connected(self, conn: SchedulerConnection) -> None: ...
    def on_scheduler_load(self, conn: SchedulerConnection) -> None: ...
    def on_scheduler_error(self, conn: SchedulerConnection, error: scheduler_pb2.RequestError) -> None: ...
    def on_scheduler_lost(self, conn: SchedulerConnection, reason: str) -> None: ...


class SchedulerConnection(PeerStream):
    """One scheduler endpoint: its Connect stream, latest load and pending control calls.
    `index`: its position in the pool's resolved list (the scheduler index session ids name)."""

    _call_ids = itertools.count(1)

    def __init__(
        self,
        index: int,
        address: str,
        origin: str,
        events: SchedulerEvents,
        stale_after_s: float = STALE_AFTER_S,
        dialer: Dialer | None = None,
    ) -> None:
        super().__init__(origin, "scheduler", dialer, endpoint=address)
        self.index = index
        self.address = address
        self.origin = origin
        self.events = events
        self.stale_after_s = stale_after_s
        self.load: common_pb2.SchedulerLoad | None = None
        self.load_at = 0.0  # time.monotonic() when `load` arrived
        self._queue: asyncio.Queue[scheduler_pb2.SchedulerInput] | None = None
        self._pending: dict[int, asyncio.Future[scheduler_pb2.SchedulerOutput]] = {}
        self._channel: grpc.aio.Channel | None = None

    @property
    def scheduler_id(self) -> str:
        return self.load.scheduler_id if self.load is not None and self.load.scheduler_id else self.address

    # ---- sending --------------------------------------------------------------------------
    def send(self, msg: scheduler_pb2.SchedulerInput) -> bool:
        """Queue a fire-and-forget message; False when the stream is down."""
        if not self.connected or self._queue is None:
            return False
        self._queue.put_nowait(msg)
        return True

    async def call(self, msg: scheduler_pb2.SchedulerInput, timeout: float) -> scheduler_pb2.SchedulerOutput:
        """Send a control message and wait for its reply (UNAVAILABLE / DEADLINE_EXCEEDED)."""
        call_id = next(self._call_ids)
        msg.call_id = call_id
        fut: asyncio.Future[scheduler_pb2.SchedulerOutput] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            if not self.send(msg):
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"scheduler {self.address} is not connected")
            return await within(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"scheduler {self.address} did not answer {msg.WhichOneof('msg')} within {timeout:.1f}s",
            ) from None
        finally:
            self._pending.pop(call_id, None)

    async def get_model_info(self, timeout: float) -> common_pb2.ModelInfo:
        """SchedulerService.GetModelInfo (unary; works while Connect is down too)."""
        channel = self._channel or self.dialer.channel(self.address)
        try:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            return await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"scheduler {self.address} GetModelInfo failed: {e.code().name} {e.details()}",
            ) from None
        finally:
            if channel is not self._channel:
                await channel.close()

    # ---- the stream -----------------------------------------------------------------------
    async def serve(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        """One Connect stream: hello and get_load first; up at the scheduler's first reply;
        over at EOF or after stale_after_s of silence."""
        queue: asyncio.Queue[scheduler_pb2.SchedulerInput] = asyncio.Queue()
        queue.put_nowait(scheduler_pb2.SchedulerInput(hello=self.hello()))
        queue.put_nowait(scheduler_pb2.SchedulerInput(get_load=scheduler_pb2.GetLoadReq()))
        self._queue = queue

        async def requests() -> AsyncIterator[scheduler_pb2.SchedulerInput]:
            while True:
                yield await queue.get()

        self._channel = channel
        call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Connect(requests())
        try:
            while True:
                try:
                    out = await within(call.read(), self.stale_after_s)
                except asyncio.TimeoutError:
                    logger.warning("scheduler %s silent for %.0fs; reconnecting", endpoint, self.stale_after_s)
                    return
                if out is grpc.aio.EOF:
                    return
                if not self.connected:
                    self.mark_up()
                    logger.info("connected to scheduler %s", endpoint)
                    self.events.on_scheduler_connected(self)
                self._dispatch(out)
        finally:
            call.cancel()
            self._channel = None

    def _dispatch(self, out: scheduler_pb2.SchedulerOutput) -> None:
        kind = out.WhichOneof("msg")
        if kind == "load":
            self.load, self.load_at = out.load, time.monotonic()
            self.events.on_scheduler_load(self)
        elif kind == "error" and out.call_id == 0:
            self.events.on_scheduler_error(self, out.error)
        fut = self._pending.get(out.call_id) if out.call_id else None
        if fut is not None and not fut.done():
            fut.set_result(out)

    def on_down(self, reason: str, was_up: bool) -> None:
        self._queue = None
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(
                    ServiceError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"scheduler {self.address} connection lost ({reason})",
                    )
                )
        if was_up:
            logger.warning("lost scheduler %s: %s", self.address, reason)
            self.events.on_scheduler_lost(self, reason)


class SchedulerPool:
    """The schedulers of an address list (a PeerSet: re-resolved every RESOLVE_INTERVAL_S). Every
    connection dials through `dialer` (plaintext by default)."""

    def __init__(
        self,
        addresses: Sequence[str],
        origin: str,
        events: SchedulerEvents,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        stale_after_s: float = STALE_AFTER_S,
        dialer: Dialer | None = None,
    ) -> None:
        self.dialer = dialer or Dialer()
        self.origin = origin
        self.events = events
        self.stale_after_s = stale_after_s
        self._peers: PeerSet[SchedulerConnection] = PeerSet(
            addresses,
            self.dialer,
            self._connection,
            "scheduler",
            resolve_interval_s,
            on_change=self._renumber,
        )

    def _connection(self, endpoint: str) -> SchedulerConnection:
        return SchedulerConnection(0, endpoint, self.origin, self.events, self.stale_after_s, self.dialer)

    @staticmethod
    def _renumber(connections: list[SchedulerConnection]) -> None:
        for i, conn in enumerate(connections):
            conn.index = i

    @property
    def connections(self) -> list[SchedulerConnection]:
        """In resolved order; each connection's index is its position here."""
        return self._peers.peers

    async def start(self) -> None:
        await self._peers.refresh()
        self._peers.start()

    async def close(self) -> None:
        await self._peers.close()

    def __len__(self) -> int:
        return len(self._peers.peers)

    def get(self, index: int) -> SchedulerConnection | None:
        conns = self.connections
        return conns[index] if 0 <= index < len(conns) else None

    def connected(self) -> list[int]:
        return [c.index for c in self.connections if c.connected]

    async def wait_any_connected(self, timeout: float) -> bool:
        return await self._peers.wait_any_up(timeout)
