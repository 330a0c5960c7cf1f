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
from typing import Optional, Protocol, Sequence

import grpc
from meshlm.common import protocol
from meshlm.common.errors import ServiceError
from meshlm.tokenizer.discovery import (
    RESOLVE_INTERVAL_S,
    Backoff,
    Dialer,
    refresh_forever,
)
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

# A scheduler reports its load every ~0.5-2 s, but the report passes through its engine loop,
# which a long forward pass can hold up: only a long silence means a dead peer.
STALE_AFTER_S = 60.0


class SchedulerEvents(Protocol):
    def on_scheduler_connected(self, conn: SchedulerConnection) -> None: ...
    def on_scheduler_load(self, conn: SchedulerConnection) -> None: ...
    def on_scheduler_error(
        self, conn: SchedulerConnection, error: scheduler_pb2.RequestError
    ) -> None: ...
    def on_scheduler_lost(self, conn: SchedulerConnection, reason: str) -> None: ...


class SchedulerConnection:
    """One scheduler endpoint: its Connect stream, latest load and pending control calls."""

    _call_ids = itertools.count(1)

    def __init__(
        self,
        index: int,
        address: str,
        origin: str,
        events: SchedulerEvents,
        stale_after_s: float = STALE_AFTER_S,
        dialer: Optional[Dialer] = None,
    ) -> None:
        self.index = index
        self.address = address
        self.origin = origin
        self.events = events
        self.stale_after_s = stale_after_s
        self.dialer = dialer or Dialer()
        self.load: Optional[common_pb2.SchedulerLoad] = None
        self.connected = False
        self._up = asyncio.Event()
        self._queue: Optional[asyncio.Queue] = None
        self._pending: dict[int, asyncio.Future] = {}
        self._channel: Optional[grpc.aio.Channel] = None
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    @property
    def scheduler_id(self) -> str:
        return (
            self.load.scheduler_id
            if self.load is not None and self.load.scheduler_id
            else self.address
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"scheduler-connect-{self.address}")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._set_down("closed")

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- sending --------------------------------------------------------------------------
    def send(self, msg: scheduler_pb2.SchedulerInput) -> bool:
        """Queue a fire-and-forget message; False when the stream is down."""
        if not self.connected or self._queue is None:
            return False
        self._queue.put_nowait(msg)
        return True

    async def call(
        self, msg: scheduler_pb2.SchedulerInput, timeout: float
    ) -> scheduler_pb2.SchedulerOutput:
        """Send a control message and wait for its reply (UNAVAILABLE / DEADLINE_EXCEEDED)."""
        call_id = next(self._call_ids)
        msg.call_id = call_id
        fut = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            if not self.send(msg):
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE, f"scheduler {self.address} is not connected"
                )
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"scheduler {self.address} did not answer {msg.WhichOneof('msg')} "
                f"within {timeout:.1f}s",
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
    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closed:
            reason = "stream ended"
            try:
                if await self._run_once():
                    backoff.reset()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # e.g. another protocol version
                    logger.error("scheduler %s refused the stream: %s", self.address, e.details())
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                logger.exception("scheduler %s stream failed", self.address)
            self._set_down(reason)
            if not self._closed:
                await backoff.sleep()

    async def _run_once(self) -> bool:
        """Run one Connect stream until it ends; True if it came up."""
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(scheduler_pb2.SchedulerInput(hello=protocol.hello(self.origin)))
        queue.put_nowait(scheduler_pb2.SchedulerInput(get_load=scheduler_pb2.GetLoadReq()))
        self._queue = queue

        async def requests():
            while True:
                yield await queue.get()

        channel = self.dialer.channel(self.address)
        self._channel = channel
        came_up = False
        try:
            call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Connect(requests())
            try:
                while True:
                    try:
                        out = await asyncio.wait_for(call.read(), self.stale_after_s)
                    except asyncio.TimeoutError:
                        logger.warning(
                            "scheduler %s silent for %.0fs; reconnecting",
                            self.address,
                            self.stale_after_s,
                        )
                        return came_up
                    if out is grpc.aio.EOF:
                        return came_up
                    if not came_up:
                        came_up = True
                        self.connected = True
                        self._up.set()
                        logger.info("connected to scheduler %s", self.address)
                        self.events.on_scheduler_connected(self)
                    self._dispatch(out)
            finally:
                call.cancel()
        finally:
            self._channel = None
            await channel.close()

    def _dispatch(self, out: scheduler_pb2.SchedulerOutput) -> None:
        kind = out.WhichOneof("msg")
        if kind == "load":
            self.load = out.load
            self.events.on_scheduler_load(self)
        elif kind == "error" and out.call_id == 0:
            self.events.on_scheduler_error(self, out.error)
        fut = self._pending.get(out.call_id) if out.call_id else None
        if fut is not None and not fut.done():
            fut.set_result(out)

    def _set_down(self, reason: str) -> None:
        was_up = self.connected
        self.connected = False
        self._up.clear()
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
    """The schedulers of an address list; re-resolves it every RESOLVE_INTERVAL_S. Every
    connection dials through `dialer` (plaintext by default)."""

    def __init__(
        self,
        addresses: Sequence[str],
        origin: str,
        events: SchedulerEvents,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        stale_after_s: float = STALE_AFTER_S,
        dialer: Optional[Dialer] = None,
    ) -> None:
        self.addresses = list(addresses)
        self.dialer = dialer or Dialer()
        self.origin = origin
        self.events = events
        self.resolve_interval_s = resolve_interval_s
        self.stale_after_s = stale_after_s
        self.connections: list[SchedulerConnection] = []
        self._task: Optional[asyncio.Task] = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        await self._refresh()
        self._task = asyncio.create_task(
            refresh_forever(self.resolve_interval_s, self._refresh, "scheduler"), name="scheduler-resolve"
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.connections), return_exceptions=True)

    def __len__(self) -> int:
        return len(self.connections)

    def get(self, index: int) -> Optional[SchedulerConnection]:
        return self.connections[index] if 0 <= index < len(self.connections) else None

    def connected(self) -> list[int]:
        return [c.index for c in self.connections if c.connected]

    async def wait_any_connected(self, timeout: float) -> bool:
        if self.connected():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.connected():
            left = deadline - loop.time()
            if left <= 0:
                return False
            waits = [asyncio.create_task(c._up.wait()) for c in self.connections]
            waits.append(asyncio.create_task(self._changed.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return True

    async def _refresh(self) -> None:
        endpoints = await self.dialer.resolve(self.addresses)
        current = {c.address: c for c in self.connections}
        if list(current) == endpoints:
            return
        kept: list[SchedulerConnection] = []
        for i, addr in enumerate(endpoints):
            conn = current.pop(addr, None)
            if conn is None:
                conn = SchedulerConnection(
                    i, addr, self.origin, self.events, self.stale_after_s, self.dialer
                )
                conn.start()
            conn.index = i
            kept.append(conn)
        self.connections = kept
        for gone in current.values():
            logger.info("scheduler %s left the address list", gone.address)
            await gone.close()
        self._changed.set()
        self._changed = asyncio.Event()
