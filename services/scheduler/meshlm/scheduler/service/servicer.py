"""SchedulerServicer: meshlm.v1.SchedulerService on top of the scheduler loop's port.

Connect (one bidi stream per tokenizer replica):
  in:  hello first (peer id and protocol version: another version is refused with
       FAILED_PRECONDITION); then generate / embed / abort / flush_cache / open_session /
       close_session / get_load (control messages carry the caller's call_id)
  out: load (on connect and periodically), control replies (same call_id), early request
       errors (draining, duplicate rid, no detokenizer reachable)
When the stream ends or breaks, every unfinished request sent on it is aborted (KV freed); those
a prefill scheduler handed over end silently (no ABORT to the detokenizer).
On a decode scheduler a prefill scheduler's stream also carries kv_chunk + prefilled and gets
handover_done back (pd_handover.py).

The servicer is the RPCs and the dispatch only: requests go to the loop through the port as
io_struct messages; the loop's outputs, control replies and crash come back on the loop thread
and are handed to the asyncio loop, where the tracker turns outputs into wire messages for the
detokenizer stream. The parts it dispatches to, each given by the server at construction:
connections.py (the streams), control.py (control-call correlation), load.py (load reports),
endings.py (aborts and early errors), pd_handover.py (the PD handover), lifecycle.py (state,
drain). Everything here runs on the service's asyncio loop, except on_output / on_control /
on_crash (loop thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from meshlm.common import protocol
from meshlm.common.errors import ServiceError
from meshlm.common.log import request_id_var
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    LoadReport,
    PrefilledReq,
)
from meshlm.scheduler.service import lifecycle, pd_handover, wire
from meshlm.scheduler.service.connections import CLOSED, Connection, ConnectionRegistry
from meshlm.scheduler.service.control import CallKind, ControlCalls
from meshlm.scheduler.service.detok_client import DetokenizerPushClient
from meshlm.scheduler.service.endings import RequestEnds
from meshlm.scheduler.service.lifecycle import ServiceState
from meshlm.scheduler.service.load import LoadReporter
from meshlm.scheduler.service.observability import RequestObserver
from meshlm.scheduler.service.pd_handover import PrefillHandover
from meshlm.scheduler.service.tracker import RequestTracker, TrackedRequest
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

CONTROL_KINDS = {kind.value: kind for kind in CallKind}  # SchedulerInput oneof name -> kind


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        put: Callable[[Any], None],
        *,
        scheduler_id: str,
        model_info: common_pb2.ModelInfo,
        state: ServiceState,
        tracker: RequestTracker,
        connections: ConnectionRegistry,
        calls: ControlCalls,
        load: LoadReporter,
        ends: RequestEnds,
        detok: DetokenizerPushClient,
        observer: RequestObserver,
        handover: PrefillHandover | None = None,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        """handover: the prefill role's. on_fatal: called once the loop crashed (the server
        stops the process)."""
        self._put = put
        self.scheduler_id = scheduler_id
        self.model_info = model_info
        self.state = state
        self.tracker = tracker
        self.connections = connections
        self.calls = calls
        self.load = load
        self.ends = ends
        self.detok = detok
        self.observer = observer
        self.handover = handover
        self._on_fatal = on_fatal
        self._aio: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle (asyncio thread) ----------------------------------------------------
    def start(self) -> None:
        self._aio = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self.load.run(), name="load-reporter"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        self.connections.close_all()

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: lifecycle.drain (refuse new requests, finish or fail the running ones)."""
        await lifecycle.drain(
            grace_s,
            scheduler_id=self.scheduler_id,
            state=self.state,
            tracker=self.tracker,
            ends=self.ends,
            detok=self.detok,
            connections=self.connections,
        )

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

    # ---- the loop's messages (asyncio thread) -------------------------------------------
    def _handle_output(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenIDOut):
            pb, tracked = self.tracker.token_out(msg, self.scheduler_id)
            if not tracked:
                return
            new_ids = {d.rid: len(d.output_ids) for d in msg.deltas}  # the wire may re-send resumed ids
            for t in tracked:
                self.observer.on_emit(t, new_ids[t.rid])
            self._send_detok(detokenizer_pb2.DetokenizerInput(tokens=pb), tracked)
        elif isinstance(msg, BatchEmbeddingOut):
            embeds, tracked = self.tracker.embedding_out(msg, self.scheduler_id)
            if not tracked:
                return
            for t in tracked:
                self.observer.on_emit(t, 0)
            self._send_detok(detokenizer_pb2.DetokenizerInput(embeddings=embeds), tracked)
        elif isinstance(msg, PrefilledReq):
            assert self.handover is not None, "PrefilledReq from a loop not in the prefill role"
            return self.handover.hand_over(msg)
        else:
            logger.error("unexpected loop output %s", type(msg).__name__)
            return
        self._release_finished(tracked)

    def _send_detok(self, msg: detokenizer_pb2.DetokenizerInput, tracked: list[TrackedRequest]) -> None:
        self.detok.send(msg, [t.rid for t in tracked])

    def _release_finished(self, tracked: list[TrackedRequest]) -> None:
        """Finished requests leave their streams; a prefill scheduler hears of its own."""
        done: dict[int, tuple[Connection, list[str]]] = {}
        for t in tracked:
            if not t.finished:
                continue
            conn = self.connections.release(t.conn_id, t.rid)
            if conn is not None and t.from_prefill:
                done.setdefault(conn.id, (conn, []))[1].append(t.rid)
        for conn, rids in done.values():
            pd_handover.report_done(conn, rids)

    def _handle_control(self, msg: Any) -> None:
        call = self.calls.resolve(msg)
        if isinstance(msg, LoadReport):
            self.load.record(msg)
        if call is None:
            return
        if call.conn_id is None:  # the periodic report: every stream gets it
            self.load.broadcast(msg)
        else:
            self.calls.reply(call, msg)

    def _handle_crash(self, message: str) -> None:
        """Fan the crash out: every live request fails (500), every pending call is answered."""
        self.state.crashed = message
        if self._on_fatal is not None:
            self._on_fatal()
        self.ends.fail_live(message, 500)
        self.calls.fail_all(message, self.load.last)

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
        conn = self.connections.open(origin)
        logger.info("tokenizer %s connected (stream %d)", conn.origin, conn.id)
        if not self.state.crashed:
            self.load.request(conn)
        reader = asyncio.create_task(self._read(conn, request_iterator))
        try:
            while True:
                item = await conn.out.get()
                if item is CLOSED:
                    break
                assert isinstance(item, scheduler_pb2.SchedulerOutput)
                yield item
        finally:
            reader.cancel()
            self.connections.remove(conn)
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
            conn.close()

    def _abort_connection(self, conn: Connection) -> None:
        """Abort what the stream brought. A tokenizer's requests end with an ABORT through the
        ring (the detokenizer drops their state). Requests a prefill scheduler handed over are
        forgotten first, so they end silently: their tokenizers are still there and hear from the
        prefill scheduler (503 "went away", then request migration) or lose it themselves; an
        ABORT from here could reach them first and end a request that was about to move."""
        live = [rid for rid in conn.rids if self.tracker.is_live(rid)]
        if live:
            logger.info("%s went away: aborting %d requests", conn.origin, len(live))
        for rid in live:
            t = self.tracker.get(rid)
            if t is not None and t.from_prefill:
                self.tracker.remove(rid)
            self.ends.abort(rid, f"tokenizer {conn.origin} disconnected")
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
        elif kind in CONTROL_KINDS:
            self._control(conn, msg, CONTROL_KINDS[kind])
        elif kind == "kv_chunk":
            pd_handover.add_kv_chunk(conn, msg.kv_chunk)
        elif kind == "prefilled":
            try:
                prefilled = pd_handover.take_prefilled(conn, msg.prefilled)
            except ValueError as e:
                return conn.send(wire.request_error(msg.prefilled.req.rid, str(e), 400))
            self._submit(conn, msg.prefilled.req, is_embedding=False, prefilled=prefilled)
        elif kind == "hello":
            logger.warning("tokenizer %s sent hello twice; ignored", conn.origin)
        else:
            logger.warning("empty SchedulerInput from %s", conn.origin)

    def _control(self, conn: Connection, msg: scheduler_pb2.SchedulerInput, kind: CallKind) -> None:
        if self.state.crashed:
            return self.calls.refuse(conn, msg.call_id, kind, self.state.crashed, self.load.last)
        self.calls.issue(conn, msg.call_id, kind, msg)

    def _abort(self, conn: Connection, pb: scheduler_pb2.AbortReq) -> None:
        message = pb.message or AbortReq.message
        if pb.abort_all:  # one tokenizer's abort_all covers its own requests only
            for rid in list(conn.rids):
                self.ends.abort(rid, message)
            return
        self.ends.abort(pb.rid, message)

    def _refusal(self, rid: str) -> tuple[str, int] | None:
        """Why rid cannot be accepted now (message, HTTP status), or None."""
        if not rid:
            return "rid must not be empty", 400
        if self.state.crashed:
            return self.state.crashed, 500
        if self.state.draining:
            return f"scheduler {self.scheduler_id} is shutting down; retry on another scheduler", 503
        if self.tracker.is_live(rid):
            return f"duplicate request id {rid!r}", 400
        return None

    def _submit(self, conn: Connection, pb: Any, *, is_embedding: bool, prefilled: PrefilledReq | None = None) -> None:
        rid = pb.rid
        token = request_id_var.set(rid)
        try:
            refusal = self._refusal(rid)
            if refusal is not None:
                return conn.send(wire.request_error(rid, *refusal))
            if is_embedding:
                req: Any = wire.embedding_req_from_proto(pb)
                seed = scheduler_pb2.DecodeSeed(prompt_tail_ids=list(pb.input_ids[-5:]))
            else:
                req = wire.generate_req_from_proto(pb)
                # The tokenizer asks for logprob text through the detokenizer; the scheduler
                # proto has no return_text_in_logprobs, so logprob requests always get text.
                seed = wire.decode_seed(req.input_ids, req.sampling_params, want_logprob_text=req.return_logprob)
            self.tracker.add(
                TrackedRequest(
                    rid=rid,
                    origin=pb.origin or conn.origin,
                    conn_id=conn.id,
                    trace=pb.trace,
                    seed=seed,
                    is_embedding=is_embedding,
                    sent=None if is_embedding else wire.resumed_delta(req),
                    from_prefill=prefilled is not None,
                )
            )
            conn.rids.add(rid)
            self._put(prefilled or req)
        finally:
            request_id_var.reset(token)
