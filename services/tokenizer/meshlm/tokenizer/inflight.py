"""The requests in flight on one tokenizer replica and the calls (RPCs) that own them.

A request is registered under its wire rid from its send until it finishes, fails or its call
closes; what the ring sends back for it (text deltas from the detokenizer subscriptions,
embeddings from the schedulers) becomes a typed event (state.Event) on its call's queue. A rid no
longer registered is dropped: finished, aborted, moved to `<rid>_retry` or `<rid>_m<k>` (a
migration), or a late resend. What each Generate output delivered is also kept
(ReqState.received) for a migration to resume from.
`idle` is set while no call is open (drain waits on it).

A streaming call whose caller takes responses as they come (Call.direct, GenerateStream) gets a
request's unfinished deltas from the callback that read them, without the queue and the wake-up
of the call's task; its last delta and any error still come through the queue.

A caller that does not read its stream (the RPC handler blocked in a yield while gRPC's flow
control is full) makes its call's queue grow; past max_stream_backlog_bytes of undelivered output
the call fails (overflow): its requests are aborted at their schedulers at once (KV freed), the
backlog is dropped and the caller gets RESOURCE_EXHAUSTED when it reads again. No other call is
affected: deliveries never wait on a consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import grpc

from meshlm.common.errors import ServiceError
from meshlm.common.finish import FinishReason
from meshlm.common.log import request_id_var
from meshlm.tokenizer.metrics import TokenizerMetrics
from meshlm.tokenizer.state import (
    Call,
    DeltaEvent,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    ReqKind,
    ReqState,
    invalid,
    read_text_delta,
)
from meshlm.v1 import detokenizer_pb2, scheduler_pb2


def abort_msg(rid: str, message: str) -> scheduler_pb2.SchedulerInput:
    return scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid=rid, message=message))


class CallScope:
    """One RPC while it runs: its call once opened, and the message its unfinished requests are
    aborted with when it ends (finished, the error's code and message, or cancelled)."""

    def __init__(self, inflight: InFlight, rid: str) -> None:
        self.inflight = inflight
        self.rid = rid
        self.call: Call | None = None
        self.end_message = "finished"

    def open(self) -> Call:
        self.call = self.inflight.open_call(self.rid)
        return self.call


class InFlight:
    def __init__(
        self, metrics: TokenizerMetrics, request_timeout_s: float, max_stream_backlog_bytes: int = 1 << 62
    ) -> None:
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.max_stream_backlog_bytes = max_stream_backlog_bytes
        self.states: dict[str, ReqState] = {}  # wire rid -> state
        self.calls: set[Call] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    # ---- bookkeeping ----------------------------------------------------------------------
    def register(self, state: ReqState) -> None:
        if state.wire_rid in self.states:
            raise invalid(f"rid {state.public_rid!r} is already in flight; request ids must be unique")
        self.states[state.wire_rid] = state
        state.call.states.append(state)

    def pop(self, state: ReqState) -> None:
        state.finished = True
        if self.states.get(state.wire_rid) is state:
            del self.states[state.wire_rid]

    def rekey(self, state: ReqState, wire_rid: str) -> None:
        """Register a state again under a new wire rid (a retry or a migration); the old rid's
        outputs are dropped, and what the request received so far (its DeltaTracker) is kept."""
        self.pop(state)
        state.finished = False
        state.wire_rid = state.req.rid = wire_rid
        self.states[wire_rid] = state

    def fail(self, state: ReqState, error: ServiceError) -> None:
        if not state.finished:
            self.pop(state)
            state.call.queue.put_nowait(ErrorEvent(state, error))

    def open_call(self, rid: str) -> Call:
        call = Call(rid, self.request_timeout_s)
        self.calls.add(call)
        self.idle.clear()
        return call

    def close_call(self, call: Call, message: str) -> None:
        """Abort what is unfinished (at its scheduler, at once) and forget the call."""
        for state in call.states:
            if not state.finished:
                self.pop(state)
                state.conn.send(abort_msg(state.wire_rid, message))
                if state.kind is not ReqKind.WARMUP:
                    self.metrics.num_aborted_requests.inc()
        call.bound.close()
        self.calls.discard(call)
        if not self.calls:
            self.idle.set()

    @contextlib.contextmanager
    def scope(self, rid: str) -> Iterator[CallScope]:
        """Run one RPC: rid in the log context; when it ends, its call closed (unfinished requests
        aborted at their schedulers with the end message)."""
        scope = CallScope(self, rid)
        token = request_id_var.set(rid)
        try:
            yield scope
        except ServiceError as e:
            scope.end_message = f"{e.code.name}: {e.message}"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            scope.end_message = "cancelled by the caller"
            raise
        finally:
            if scope.call is not None:
                self.close_call(scope.call, scope.end_message)
            with contextlib.suppress(ValueError):  # closed from another context
                request_id_var.reset(token)

    async def next_event(self, call: Call) -> Event:
        try:
            return await call.bound.wait(call.queue.get())
        except asyncio.TimeoutError:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request {call.rid}: no output for request_timeout_s={self.request_timeout_s:g}s",
            ) from None

    # ---- outputs from the ring ------------------------------------------------------------
    def on_batch_str_out(self, batch: detokenizer_pb2.BatchStrOut) -> None:
        now = time.monotonic()
        for d in batch.deltas:
            state = self.states.get(d.rid)
            if state is None:
                continue  # not ours any more (finished, aborted, moved) or a late resend
            if state.kind is ReqKind.EMBED:
                self._embed_rejected(state, d)
                continue
            delta = read_text_delta(state, d)
            if delta is None:
                continue
            if state.kind is ReqKind.GENERATE and (delta.text or delta.ids):
                self.metrics.observe_tokens(state, len(delta.ids), now)
                state.received.record(delta.ids, delta.logprobs, state.req.return_logprob)
            if delta.finish is not None:
                self.pop(state)
                if state.kind is ReqKind.GENERATE:
                    self.metrics.observe_finish(state, delta.finish, now)
            call = state.call
            if delta.finish is None and call.direct is not None:
                call.direct(state, delta)
                call.bound.renew()  # output arrived: the request is not idle
                continue
            call.queue.put_nowait(DeltaEvent(state, delta))
            if call.queue.nbytes > self.max_stream_backlog_bytes:
                self.overflow(call)

    def overflow(self, call: Call) -> None:
        """The caller is not reading: abort the call's unfinished requests, drop its backlog and
        queue the error it ends with (see the module docstring)."""
        backlog = call.queue.nbytes
        message = (
            f"request {call.rid}: the caller did not read its stream ({backlog} bytes of output undelivered,"
            f" max_stream_backlog_bytes={self.max_stream_backlog_bytes}); aborted"
        )
        error = ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        call.queue.drop_all()
        for state in call.states:
            if not state.finished:
                self.pop(state)
                state.conn.send(abort_msg(state.wire_rid, "the caller did not read its stream"))
                self.metrics.num_aborted_requests.inc()
        self.metrics.num_slow_stream_aborts.inc()
        state0 = call.states[0]
        call.queue.put_nowait(ErrorEvent(state0, error))

    def _embed_rejected(self, state: ReqState, d: detokenizer_pb2.TextDelta) -> None:
        """The scheduler loop rejects an embedding request (bad input, queue full) with a token
        delta that finishes it with ABORT; anything else for an Embed prompt is ignored."""
        finish = FinishReason.from_proto(d.finish_reason)
        if finish is not None and finish.is_abort:
            self.pop(state)
            state.call.queue.put_nowait(EmbeddingEvent(state, [], finish))

    def on_batch_embedding_out(self, batch: scheduler_pb2.BatchEmbeddingOut) -> None:
        for result in batch.results:
            state = self.states.get(result.rid)
            if state is None or state.kind is not ReqKind.EMBED:
                continue
            state.prompt_tokens = result.prompt_tokens
            state.produced = True
            self.pop(state)
            finish = FinishReason.from_proto(result.finish_reason)
            state.call.queue.put_nowait(EmbeddingEvent(state, list(result.embedding), finish))
