"""SchedulerServicer: meshlm.v1.SchedulerService on top of the scheduler loop's port.

Connect (one bidi stream per tokenizer replica):
  in:  hello first (peer id and protocol version: another version is refused with
       FAILED_PRECONDITION); then generate / embed / abort / flush_cache / open_session /
       close_session / get_load (control messages carry the caller's call_id)
  out: load (on connect and periodically), control replies (same call_id), early request
       errors (draining, duplicate rid, no detokenizer reachable)
When the stream ends or breaks, every unfinished request sent on it is aborted (KV freed).

Prefill/decode disaggregation: a prefill scheduler's loop emits PrefilledReq for each prompt
it computed; the servicer hands it to a decode scheduler through `handoff` and keeps the
request tracked (aborts are forwarded) until that scheduler reports it done. A decode
scheduler takes kv_chunk + prefilled messages on a Connect stream opened by a prefill
scheduler, tracks them like any request (outputs to its detokenizer, routed by the request's
origin), and answers handover_done on that stream when they finish.

The servicer is thin: requests go to the loop through the port as io_struct messages; the
loop's outputs come back on the loop thread and are handed to the asyncio loop, where the
tracker turns them into wire messages for the detokenizer stream. Everything here runs on the
service's asyncio loop, except on_output / on_control / on_crash (loop thread).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import grpc
from meshlm.common import protocol
from meshlm.common.errors import ServiceError
from meshlm.common.log import request_id_var
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    CloseSessionOutput,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    LoadReport,
    OpenSessionOutput,
    PrefilledReq,
)
from meshlm.scheduler.service import wire
from meshlm.scheduler.service.detok_client import DetokenizerPushClient
from meshlm.scheduler.service.handoff import DecodeHandoffClient
from meshlm.scheduler.service.handoff_wire import prefilled_from_proto
from meshlm.scheduler.service.observability import RequestObserver, SchedulerMetrics
from meshlm.scheduler.service.tracker import RequestTracker, TrackedRequest
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

_CLOSED = object()  # ends a Connect stream's output
IDLE_LOAD_FACTOR = 4  # idle: a load report every 4 intervals (0.5 s busy -> 2 s idle)


@dataclass
class Connection:
    id: int
    origin: str
    out: "asyncio.Queue[Any]" = field(default_factory=asyncio.Queue)
    rids: set[str] = field(default_factory=set)
    kv_parts: dict[str, bytearray] = field(default_factory=dict)  # rid -> KV chunks received so far

    def send(self, msg: scheduler_pb2.SchedulerOutput) -> None:
        self.out.put_nowait(msg)


@dataclass
class _Call:
    conn_id: Optional[int]  # None: the servicer's own (periodic load)
    call_id: int  # the caller's
    kind: str  # flush_cache | open_session | close_session | get_load


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        put: Callable[[Any], None],
        *,
        scheduler_id: str,
        model_info: common_pb2.ModelInfo,
        tracker: RequestTracker,
        metrics: Optional[SchedulerMetrics] = None,
        load_interval_s: float = 0.5,
    ) -> None:
        self._put = put
        self.scheduler_id = scheduler_id
        self.model_info = model_info
        self.tracker = tracker
        self.metrics = metrics
        self.observer = RequestObserver(metrics, scheduler_id)
        self.load_interval_s = load_interval_s
        self.detok: Optional[DetokenizerPushClient] = None  # set by the server (they need each other)
        self.handoff: Optional[DecodeHandoffClient] = None  # prefill role: set by the server
        self.draining = False
        self.crashed: Optional[str] = None
        self.on_fatal: Optional[Callable[[], None]] = None  # the server stops the process
        self.last_load: Optional[LoadReport] = None
        self._conns: dict[int, Connection] = {}
        self._calls: dict[int, _Call] = {}
        self._conn_ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self._aio: Optional[asyncio.AbstractEventLoop] = None
        self._tasks: list[asyncio.Task] = []
        self._last_broadcast = 0.0

    # ---- life cycle (asyncio thread) ----------------------------------------------------
    def start(self) -> None:
        self._aio = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._load_reporter(), name="load-reporter"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self.close_connections()

    def close_connections(self) -> None:
        for conn in list(self._conns.values()):
            conn.out.put_nowait(_CLOSED)

    # ---- loop-thread callbacks ----------------------------------------------------------
    def on_output(self, msg: Any) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._handle_output, msg)

    def on_control(self, msg: Any) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._handle_control, msg)

    def on_crash(self, exc: BaseException) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._handle_crash, f"scheduler loop crashed: {exc!r}")

    # ---- outputs (asyncio thread) -------------------------------------------------------
    def _handle_output(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenIDOut):
            pb, tracked = self.tracker.token_out(msg, self.scheduler_id)
            if not tracked:
                return
            for t, delta in zip(tracked, pb.deltas):
                self.observer.on_emit(t, len(delta.output_ids))
            self._send_detok(detokenizer_pb2.DetokenizerInput(tokens=pb), [t.rid for t in tracked])
        elif isinstance(msg, BatchEmbeddingOut):
            embeds, tracked = self.tracker.embedding_out(msg, self.scheduler_id)
            if not tracked:
                return
            for t in tracked:
                self.observer.on_emit(t, 0)
            self._send_detok(detokenizer_pb2.DetokenizerInput(embeddings=embeds), [t.rid for t in tracked])
        elif isinstance(msg, PrefilledReq):
            return self._hand_over(msg)
        else:
            logger.error("unexpected loop output %s", type(msg).__name__)
            return
        done: dict[int, list[str]] = {}
        for t in tracked:
            if t.finished:
                conn = self._conns.get(t.conn_id)
                if conn is not None:
                    conn.rids.discard(t.rid)
                    if t.from_prefill:
                        done.setdefault(conn.id, []).append(t.rid)
        for conn_id, rids in done.items():
            self._conns[conn_id].send(
                scheduler_pb2.SchedulerOutput(handover_done=scheduler_pb2.HandoverDone(rids=rids))
            )

    # ---- disaggregation: the prefill side (asyncio thread) ------------------------------
    def _hand_over(self, msg: PrefilledReq) -> None:
        t = self.tracker.get(msg.req.rid)
        if t is None or t.finished:
            return  # failed meanwhile: its KV is already back in this scheduler's pool
        if t.abort_requested:
            return self._fail(t, "Aborted by the client", 499)
        assert self.handoff is not None
        endpoint = self.handoff.hand_over(msg, t.origin, t.trace)
        if endpoint is None:
            return self._fail(t, f"scheduler {self.scheduler_id}: no decode scheduler reachable", 503)
        t.handed_to = endpoint

    def on_handover_error(self, rid: str, reason: common_pb2.FinishReason) -> None:
        """A decode scheduler rejected a handed-over request: the error goes to its tokenizer."""
        t = self.tracker.remove(rid)
        conn = self._conns.get(t.conn_id) if t is not None else None
        if conn is not None:
            conn.rids.discard(rid)
            conn.send(scheduler_pb2.SchedulerOutput(error=scheduler_pb2.RequestError(rid=rid, reason=reason)))

    def on_handover_lost(self, rids: list[str], message: str) -> None:
        for rid in rids:
            t = self.tracker.get(rid)
            if t is not None:
                self._fail(t, message, 503)

    def on_handover_done(self, rids: list[str]) -> None:
        for rid in rids:
            t = self.tracker.remove(rid)
            conn = self._conns.get(t.conn_id) if t is not None else None
            if conn is not None:
                conn.rids.discard(rid)

    def _abort_rid(self, rid: str, message: str, abort_all: bool = False) -> None:
        """Abort in this loop and, for requests handed to a decode scheduler, there too."""
        self._put(AbortReq(rid=rid, abort_all=abort_all, message=message))
        t = self.tracker.get(rid)
        if t is not None:
            t.abort_requested = True
        if self.handoff is not None:
            self.handoff.abort(rid, abort_all, message)

    def _send_detok(self, msg: detokenizer_pb2.DetokenizerInput, rids: list[str]) -> None:
        assert self.detok is not None
        self.detok.send(msg, rids)

    def _handle_control(self, msg: Any) -> None:
        call = self._calls.pop(getattr(msg, "call_id", 0), None)
        if isinstance(msg, LoadReport):
            self.last_load = msg
            if self.metrics is not None:
                self.metrics.update_load(msg)
        if call is None:
            logger.warning("control reply %s matches no call", type(msg).__name__)
            return
        if call.conn_id is None:  # the periodic report: every stream gets it
            self._broadcast_load(msg)
            return
        conn = self._conns.get(call.conn_id)
        if conn is not None:
            conn.send(wire.control_reply(call.call_id, msg, self.scheduler_id))

    def _broadcast_load(self, load: LoadReport) -> None:
        self._last_broadcast = time.monotonic()
        pb = scheduler_pb2.SchedulerOutput(load=wire.load_to_proto(load, self.scheduler_id))
        for conn in self._conns.values():
            conn.send(pb)

    def _handle_crash(self, message: str) -> None:
        self.crashed = message
        if self.on_fatal is not None:
            self.on_fatal()
        for t in self.tracker.live():
            self._fail(t, message, 500)
        for internal, call in list(self._calls.items()):
            del self._calls[internal]
            conn = self._conns.get(call.conn_id) if call.conn_id is not None else None
            if conn is not None:
                self._fail_call(conn, call.call_id, call.kind, message)

    def _fail_call(self, conn: Connection, call_id: int, kind: str, message: str) -> None:
        """Answer a control call the loop cannot answer (it crashed)."""
        reply: Any = {
            "flush_cache": FlushCacheOutput(False, message),
            "open_session": OpenSessionOutput(None, False, message),
            "close_session": CloseSessionOutput("", False, message),
            "get_load": self.last_load,
        }.get(kind)
        if reply is not None:
            conn.send(wire.control_reply(call_id, reply, self.scheduler_id))

    def fail_unavailable(self, rids: list[str]) -> None:
        """The detokenizer client's deadline passed for these requests."""
        for rid in rids:
            t = self.tracker.get(rid)
            if t is not None:
                self._fail(t, f"scheduler {self.scheduler_id}: no detokenizer reachable", 503)

    def _fail(self, t: TrackedRequest, message: str, status_code: int) -> None:
        """End a request outside the ring: error on its Connect stream, abort in the loop."""
        self.tracker.remove(t.rid)
        if not t.finished:
            self._abort_rid(t.rid, message)
        conn = self._conns.get(t.conn_id)
        if conn is not None:
            conn.rids.discard(t.rid)
            conn.send(wire.request_error(t.rid, message, status_code))

    # ---- periodic load ------------------------------------------------------------------
    def _request_load(self, conn: Optional[Connection]) -> None:
        internal = next(self._call_ids)
        self._calls[internal] = _Call(conn.id if conn else None, 0, "get_load")
        self._put(GetLoadReq(call_id=internal))

    async def _load_reporter(self) -> None:
        while True:
            await asyncio.sleep(self.load_interval_s)
            try:
                self.tracker.expire()
                if self.crashed or not self._conns:
                    continue
                last = self.last_load
                busy = self.tracker.num_live() > 0 or (
                    last is not None and (last.num_running_reqs or last.num_queue_reqs)
                )
                idle_due = time.monotonic() - self._last_broadcast >= self.load_interval_s * IDLE_LOAD_FACTOR
                if busy or idle_due:
                    self._request_load(None)
            except Exception:
                logger.exception("load reporter")

    # ---- RPCs ---------------------------------------------------------------------------
    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.model_info

    async def Connect(
        self, request_iterator: AsyncIterator[scheduler_pb2.SchedulerInput], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SchedulerOutput]:
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        try:
            origin = protocol.check_hello(first.WhichOneof("msg"), first.hello, "scheduler", "Connect")
        except ServiceError as e:
            logger.warning("refused a Connect stream: %s", e.message)
            await context.abort(e.code, e.message)
        conn = Connection(next(self._conn_ids), origin)
        self._conns[conn.id] = conn
        logger.info("tokenizer %s connected (stream %d)", conn.origin, conn.id)
        if not self.crashed:
            self._request_load(conn)
        reader = asyncio.create_task(self._read(conn, request_iterator))
        try:
            while True:
                item = await conn.out.get()
                if item is _CLOSED:
                    break
                yield item
        finally:
            reader.cancel()
            self._conns.pop(conn.id, None)
            self._abort_connection(conn)

    async def _read(self, conn: Connection, it: AsyncIterator[scheduler_pb2.SchedulerInput]) -> None:
        try:
            async for msg in it:
                try:
                    self._dispatch(conn, msg)
                except Exception:
                    logger.exception("bad SchedulerInput from %s", conn.origin)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.info("Connect stream of %s broke: %s", conn.origin, e)
        finally:
            conn.out.put_nowait(_CLOSED)

    def _abort_connection(self, conn: Connection) -> None:
        live = [rid for rid in conn.rids if self.tracker.is_live(rid)]
        if live:
            logger.info("tokenizer %s went away: aborting %d requests", conn.origin, len(live))
        for rid in live:
            self._abort_rid(rid, f"tokenizer {conn.origin} disconnected")
        conn.rids.clear()
        conn.kv_parts.clear()

    # ---- inputs -------------------------------------------------------------------------
    def _dispatch(self, conn: Connection, msg: scheduler_pb2.SchedulerInput) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "generate":
            self._submit(conn, msg.generate, is_embedding=False)
        elif kind == "embed":
            self._submit(conn, msg.embed, is_embedding=True)
        elif kind == "abort":
            self._abort(conn, msg.abort)
            if msg.call_id:
                conn.send(scheduler_pb2.SchedulerOutput(call_id=msg.call_id, ack=True))
        elif kind == "flush_cache":
            self._control(conn, msg.call_id, "flush_cache", lambda cid: FlushCacheReq(call_id=cid))
        elif kind == "open_session":
            self._control(conn, msg.call_id, "open_session", lambda cid: wire.open_session_from_proto(msg.open_session, cid))
        elif kind == "close_session":
            self._control(conn, msg.call_id, "close_session", lambda cid: wire.close_session_from_proto(msg.close_session, cid))
        elif kind == "get_load":
            self._control(conn, msg.call_id, "get_load", lambda cid: GetLoadReq(call_id=cid))
        elif kind == "kv_chunk":
            conn.kv_parts.setdefault(msg.kv_chunk.rid, bytearray()).extend(msg.kv_chunk.data)
        elif kind == "prefilled":
            raw = conn.kv_parts.pop(msg.prefilled.req.rid, bytearray())
            try:
                prefilled = prefilled_from_proto(msg.prefilled, raw)
            except ValueError as e:
                return conn.send(wire.request_error(msg.prefilled.req.rid, str(e), 400))
            self._submit(conn, msg.prefilled.req, is_embedding=False, prefilled=prefilled)
        elif kind == "hello":
            logger.warning("tokenizer %s sent hello twice; ignored", conn.origin)
        else:
            logger.warning("empty SchedulerInput from %s", conn.origin)

    def _control(self, conn: Connection, call_id: int, kind: str, make: Callable[[int], Any]) -> None:
        if self.crashed:
            return self._fail_call(conn, call_id, kind, self.crashed)
        internal = next(self._call_ids)
        self._calls[internal] = _Call(conn.id, call_id, kind)
        self._put(make(internal))

    def _abort(self, conn: Connection, pb: scheduler_pb2.AbortReq) -> None:
        message = pb.message or AbortReq.message
        if pb.abort_all:  # one tokenizer's abort_all covers its own requests only
            for rid in list(conn.rids):
                self._abort_rid(rid, message)
            return
        self._abort_rid(pb.rid, message)

    def _submit(
        self, conn: Connection, pb: Any, *, is_embedding: bool, prefilled: Optional[PrefilledReq] = None
    ) -> None:
        rid = pb.rid
        token = request_id_var.set(rid)
        try:
            origin = pb.origin or conn.origin
            if not rid:
                return conn.send(wire.request_error(rid, "rid must not be empty", 400))
            if self.crashed:
                return conn.send(wire.request_error(rid, self.crashed, 500))
            if self.draining:
                return conn.send(wire.request_error(
                    rid, f"scheduler {self.scheduler_id} is shutting down; retry on another scheduler", 503
                ))
            if self.tracker.is_live(rid):
                return conn.send(wire.request_error(rid, f"duplicate request id {rid!r}", 400))
            if is_embedding:
                req: Any = wire.embedding_req_from_proto(pb)
                seed = scheduler_pb2.DecodeSeed(prompt_tail_ids=list(pb.input_ids[-5:]))
            else:
                req = wire.generate_req_from_proto(pb)
                # The tokenizer asks for logprob text through the detokenizer; the scheduler
                # proto has no return_text_in_logprobs, so logprob requests always get text.
                seed = wire.decode_seed(req.input_ids, req.sampling_params, want_logprob_text=req.return_logprob)
            self.tracker.add(TrackedRequest(
                rid=rid, origin=origin, conn_id=conn.id, trace=pb.trace, seed=seed,
                is_embedding=is_embedding, from_prefill=prefilled is not None,
            ))
            conn.rids.add(rid)
            self._put(prefilled or req)
        finally:
            request_id_var.reset(token)

    # ---- drain --------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        """Stop accepting requests, let running ones finish within grace_s, abort the rest,
        flush their outputs to the detokenizer, then end every Connect stream."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        finish_by = deadline - min(1.5, grace_s / 2)
        while self.tracker.num_live() and time.monotonic() < finish_by and not self.crashed:
            await asyncio.sleep(0.05)
        left = self.tracker.live()
        if left:
            logger.warning("grace period over: aborting %d requests", len(left))
            for t in left:  # 503 on the Connect stream: the tokenizer may retry elsewhere
                self._fail(t, f"scheduler {self.scheduler_id} shut down before the request finished", 503)
        if self.detok is not None:
            await self.detok.flush(max(deadline - time.monotonic() - 0.2, 0.1))
        self.close_connections()
