"""DecodeHandoffClient: a prefill scheduler's Connect streams to its decode schedulers.

A prefill scheduler is a tokenizer to its decode schedulers: one Connect stream per decode
endpoint (headless-service names re-resolved), hello peer_id "prefill/<scheduler id>". Each
prefilled request goes, as KV chunks + PrefilledReq, to the up link with the fewest requests
handed over and not finished yet (then the lowest token usage). The link remembers those rids
until the decode scheduler reports them done (HandoverDone) or rejects one (RequestError).

Failure rules (nothing is lost): a request with no link up fails at once (caller gets None);
when a link breaks, every request it carried is reported through `on_lost` (the decode
scheduler aborts them itself when the stream ends), and the link reconnects with backoff.
Owned by the service's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Sequence

import grpc
from meshlm.common import addresses, protocol
from meshlm.common.tls import PLAINTEXT, TlsConfig, aio_channel
from meshlm.scheduler.managers.io_struct import PrefilledReq
from meshlm.scheduler.service.handoff_wire import prefilled_to_proto
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
RESOLVE_INTERVAL_S = 5.0
Resolver = Callable[[str], Awaitable[list[str]]]
ErrorCallback = Callable[[str, common_pb2.FinishReason], None]
LostCallback = Callable[[list[str], str], None]
DoneCallback = Callable[[list[str]], None]


@dataclass
class DecodeLink:
    """One Connect stream to one decode endpoint. `rids`: handed over, not done yet."""

    endpoint: str
    queue: "asyncio.Queue[scheduler_pb2.SchedulerInput]" = field(default_factory=asyncio.Queue)
    rids: set[str] = field(default_factory=set)
    up: bool = False
    load: Optional[common_pb2.SchedulerLoad] = None
    task: Optional[asyncio.Task] = None

    def score(self) -> tuple[int, float]:
        return len(self.rids), (self.load.token_usage if self.load is not None else 0.0)


class DecodeHandoffClient:
    def __init__(
        self,
        scheduler_id: str,
        addrs: Sequence[str],
        *,
        on_error: ErrorCallback,
        on_lost: LostCallback,
        on_done: DoneCallback,
        tls: Optional[TlsConfig] = None,
        resolver: Resolver = addresses.resolve,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.scheduler_id = scheduler_id
        self.addrs = list(addrs)
        self.on_error, self.on_lost, self.on_done = on_error, on_lost, on_done
        self.tls = tls or PLAINTEXT
        self._resolver = resolver
        self.connect_timeout_s = connect_timeout_s
        self.links: dict[str, DecodeLink] = {}
        self._names: dict[str, str] = {}
        self._task: Optional[asyncio.Task] = None
        self._up_event = asyncio.Event()

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._discover(), name="decode-discovery")

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up_event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def any_up(self) -> bool:
        return any(link.up for link in self.links.values())

    async def close(self) -> None:
        tasks = [t for t in [self._task, *(link.task for link in self.links.values())] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.links.clear()

    # ---- requests -----------------------------------------------------------------------
    def hand_over(self, msg: PrefilledReq, origin: str, trace: Optional[common_pb2.TraceContext]) -> Optional[str]:
        """Queue msg on the least busy up link; its endpoint, or None when no link is up."""
        up = [link for link in self.links.values() if link.up]
        if not up:
            return None
        link = min(up, key=DecodeLink.score)
        for pb in prefilled_to_proto(msg, origin, trace):
            link.queue.put_nowait(pb)
        link.rids.add(msg.req.rid)
        return link.endpoint

    def abort(self, rid: str, abort_all: bool, message: str) -> None:
        """Forward an abort to every link carrying a matching request (rid, or "<rid>_<i>")."""
        for link in self.links.values():
            hits = [r for r in link.rids if abort_all or r == rid or r.startswith(rid + "_")]
            for r in hits:
                link.queue.put_nowait(scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid=r, message=message)))

    # ---- discovery and streams ----------------------------------------------------------
    async def _endpoints(self) -> list[str]:
        return await addresses.resolve_all(self.addrs, self._names, self._resolver)

    async def _discover(self) -> None:
        while True:
            try:
                endpoints = await self._endpoints()
            except Exception:
                logger.exception("cannot resolve decode scheduler addresses %s", self.addrs)
                endpoints = list(self.links)
            for ep in endpoints:
                if ep not in self.links:
                    link = DecodeLink(ep)
                    link.task = asyncio.create_task(self._run(link), name=f"decode-link-{ep}")
                    self.links[ep] = link
            for ep in [e for e in self.links if e not in endpoints]:
                link = self.links.pop(ep)
                if link.task is not None:
                    link.task.cancel()
                self._lose(link, f"decode scheduler {ep} left the address list")
            await asyncio.sleep(RESOLVE_INTERVAL_S)

    async def _run(self, link: DecodeLink) -> None:
        backoff = 0.05
        while True:
            served = await self._serve(link)
            backoff = 0.05 if served else min(backoff * 2, 2.0)
            await asyncio.sleep(backoff)

    async def _serve(self, link: DecodeLink) -> bool:
        """Run one Connect stream until it breaks; True if it was ever up."""
        channel = aio_channel(link.endpoint, self.tls, CHANNEL_OPTIONS, self._names.get(link.endpoint))
        was_up = False
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.connect_timeout_s)
            except (asyncio.TimeoutError, grpc.RpcError):
                return False
            hello = scheduler_pb2.SchedulerInput(hello=protocol.hello(f"prefill/{self.scheduler_id}"))

            async def requests():  # type: ignore[no-untyped-def]
                yield hello
                while True:
                    yield await link.queue.get()

            call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Connect(requests())
            link.up = was_up = True
            self._up_event.set()
            logger.info("decode scheduler %s connected", link.endpoint)
            async for out in call:
                self._on_output(link, out)
            raise ConnectionError("closed by the decode scheduler")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if was_up:
                logger.warning("decode scheduler %s stream failed: %s", link.endpoint, e)
            return was_up
        finally:
            link.up = False
            if not any(x.up for x in self.links.values()):
                self._up_event.clear()
            self._lose(link, f"decode scheduler {link.endpoint} went away before the request finished")
            await channel.close(grace=None)

    def _lose(self, link: DecodeLink, message: str) -> None:
        while not link.queue.empty():
            link.queue.get_nowait()
        lost, link.rids = sorted(link.rids), set()
        if lost:
            self.on_lost(lost, message)

    def _on_output(self, link: DecodeLink, out: scheduler_pb2.SchedulerOutput) -> None:
        kind = out.WhichOneof("msg")
        if kind == "load":
            link.load = out.load
        elif kind == "handover_done":
            done = [r for r in out.handover_done.rids if r in link.rids]
            link.rids.difference_update(done)
            if done:
                self.on_done(done)
        elif kind == "error":
            if out.error.rid in link.rids:
                link.rids.discard(out.error.rid)
                self.on_error(out.error.rid, out.error.reason)
