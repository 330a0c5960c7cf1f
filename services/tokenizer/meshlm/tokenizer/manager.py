"""TokenizerManager: SGLang's TokenizerManager over the meshlm ring (docs/ring.md).

One Generate: normalise + tokenise (request.py) -> admission (max_queued_requests) -> wait for
the ring (a detokenizer subscription and a scheduler stream, connect_timeout_s) -> route each
prompt to a scheduler (Router; a session's own scheduler) -> [n>1: one max_new_tokens=0 request
per prompt, awaited, so the n samples reuse its radix-cache prefix instead of prefilling n times
(SGLang's _handle_batch_request); --parallel-sample-warmup false relies on the radix cache alone]
-> one TokenizedGenerateReqInput per output -> consume deltas.

Deltas arrive from the detokenizer subscriptions (on_batch_str_out), are de-duplicated per
request (state.read_text_delta) and queued, as typed events (state.Event), to the call that owns
the request. Every wait has a
deadline: no output for request_timeout_s -> DEADLINE_EXCEEDED. Whatever ends a call early
(error, deadline, the caller cancelling) sends an AbortReq for each unfinished request at once.

A scheduler stream that breaks fails that scheduler's requests with UNAVAILABLE, except those
that produced nothing yet and were not retried: they are re-sent once to another connected
scheduler as `<rid>_retry` (a fresh wire rid, so a late abort from the lost scheduler cannot
hit the retry); the same for a RequestError with status 503 (scheduler draining, or without a
detokenizer). Sessions never move.

Errors are `ServiceError(grpc code, message)`; an ABORT finish maps its status_code through
FinishReason.grpc_code (meshlm.common.finish: 400 INVALID_ARGUMENT, 404 NOT_FOUND, 499/0
CANCELLED, 503 RESOURCE_EXHAUSTED, else INTERNAL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from meshlm.common.channels import Dialer
from meshlm.common.errors import ServiceError
from meshlm.common.finish import FinishReason
from meshlm.common.log import request_id_var
from meshlm.common.metrics import Metrics
from meshlm.common.telemetry import current_traceparent, span, start_span
from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.control import ControlPlane
from meshlm.tokenizer.detokenizer_client import DetokenizerPool
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.metrics import TokenizerMetrics
from meshlm.tokenizer.request import (
    InvalidRequest,
    check_token_ids,
    new_rid,
    normalize_embed,
    normalize_generate,
    tokenize_prompt,
)
from meshlm.tokenizer.routing import Router, session_scheduler
from meshlm.tokenizer.scheduler_client import SchedulerConnection, SchedulerPool
from meshlm.tokenizer.state import (
    Call,
    Delta,
    DeltaEvent,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    ReqKind,
    ReqState,
    error_from_finish,
    error_reason,
    invalid,
    read_text_delta,
    strip_logprob_text,
)
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, tokenizer_pb2

logger = logging.getLogger(__name__)


def _abort_msg(rid: str, message: str) -> scheduler_pb2.SchedulerInput:
    return scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid=rid, message=message))


class TokenizerManager:
    def __init__(
        self, config: TokenizerConfig, tokenizer: HFTokenizer | None = None, metrics: Metrics | None = None
    ) -> None:
        self.config = config
        self.origin = config.tokenizer_id
        self.tokenizer = tokenizer
        self.router = Router(config.routing_policy)
        self.metrics = TokenizerMetrics(metrics)
        dialer = Dialer(config.tls)
        self.schedulers = SchedulerPool(config.scheduler_addrs, self.origin, self, dialer=dialer)
        self.detokenizers = DetokenizerPool(
            config.detokenizer_addrs, self.origin, self.on_batch_str_out, self.on_batch_embedding_out, dialer=dialer
        )
        self.control = ControlPlane(self)
        self.states: dict[str, ReqState] = {}  # wire rid -> state
        self.calls: set[Call] = set()
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._bg: list[asyncio.Task] = []

    @property
    def model_info(self) -> common_pb2.ModelInfo | None:
        return self.control.model_info

    # ---- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        await self.schedulers.start()
        await self.detokenizers.start()
        self._bg.append(asyncio.create_task(self.control.prefetch_model_info()))

    async def close(self) -> None:
        for t in self._bg:
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        await self.schedulers.close()
        await self.detokenizers.close()

    def peers_ready(self) -> bool:
        """Readiness: a scheduler stream and a detokenizer subscription are up, not draining."""
        return not self.draining and bool(self.schedulers.connected()) and bool(self.detokenizers.connected())

    async def load_tokenizer(self, timeout: float = 600.0) -> HFTokenizer:
        """The tokenizer of config.tokenizer_path, else of the tokenizer_path a scheduler
        reports in GetModelInfo (waits up to `timeout` for one)."""
        if self.tokenizer is not None:
            return self.tokenizer
        path = self.config.tokenizer_path
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while path is None:
            try:
                path = (await self.control.get_model_info()).tokenizer_path
                if not path:
                    raise RuntimeError("the scheduler reports no tokenizer_path; pass --tokenizer-path")
            except ServiceError as e:
                if loop.time() > deadline:
                    raise RuntimeError(f"no tokenizer path: {e.message}; pass --tokenizer-path") from e
                logger.info("waiting for a scheduler to learn the tokenizer path: %s", e.message)
                await asyncio.sleep(1.0)
        self.tokenizer = await asyncio.to_thread(HFTokenizer, path)
        logger.info("loaded tokenizer from %s (vocab %d)", path, self.tokenizer.vocab_size)
        return self.tokenizer

    def start_draining(self) -> None:
        self.draining = True

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (UNAVAILABLE); in-flight ones get grace_s to finish, then they
        are aborted at their schedulers and fail with UNAVAILABLE."""
        self.start_draining()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, grace_s))
            return
        except asyncio.TimeoutError:
            pass  # still busy: abort what is left
        err = ServiceError(grpc.StatusCode.UNAVAILABLE, "tokenizer is shutting down; request aborted")
        for state in list(self.states.values()):
            state.conn.send(_abort_msg(state.wire_rid, "tokenizer shutting down"))
            self._fail(state, err)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=2.0)

    # ---- checks and routing ---------------------------------------------------------------
    def _tok(self) -> HFTokenizer:
        if self.tokenizer is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "tokenizer is not loaded yet")
        return self.tokenizer

    def vocab_size(self) -> int:
        info = self.model_info
        return info.vocab_size if info is not None and info.vocab_size > 0 else self._tok().vocab_size

    def max_input_len(self) -> int:
        return self.model_info.max_req_input_len if self.model_info is not None else 0

    def check_accepting(self) -> None:
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "tokenizer is draining (shutting down); retry elsewhere")

    def _check_model_kind(self, generation: bool) -> None:
        """Generate needs a generation model (enforced once the model info is known). Embed
        works on both kinds: a decoder model embeds by last-token pooling."""
        info = self.model_info
        if info is None or not generation or info.is_generation:
            return
        name = info.served_model_name or info.model_path
        raise invalid(f"model {name!r} is an embedding model; use Embed, not Generate")

    def _admit(self, count: int) -> None:
        limit = self.config.max_queued_requests
        if count > limit:
            raise invalid(
                f"the request fans out to {count} requests (prompts x n); "
                f"at most max_queued_requests={limit} are allowed"
            )
        if len(self.states) + count > limit:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many requests in flight ({len(self.states)}); max_queued_requests={limit}",
            )

    async def _wait_ring(self) -> None:
        timeout = self.config.connect_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if not await self.detokenizers.wait_any_connected(timeout):
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"no detokenizer reachable at {','.join(self.config.detokenizer_addrs)}"
                f" within connect_timeout_s={timeout:g}",
            )
        if not await self.schedulers.wait_any_connected(max(0.0, deadline - loop.time())):
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"no scheduler reachable at {','.join(self.config.scheduler_addrs)}"
                f" within connect_timeout_s={timeout:g}",
            )

    def _load_of(self, index: int) -> common_pb2.SchedulerLoad | None:
        conn = self.schedulers.get(index)
        return conn.load if conn is not None else None

    def route(self, session_id: str = "") -> SchedulerConnection:
        """The scheduler for a new request: the session's, or one the policy picks."""
        if session_id:
            j = session_scheduler(session_id, len(self.schedulers))
            conn = self.schedulers.get(j) if j is not None else None
            if conn is None:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"session_id {session_id!r} is unknown")
            if not conn.connected:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the scheduler of session {session_id!r} ({conn.address}) is not connected",
                )
            return conn
        connected = self.schedulers.connected()
        if not connected:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no scheduler is connected")
        return self.schedulers.get(self.router.choose(connected, self._load_of))

    # ---- request bookkeeping --------------------------------------------------------------
    def _register(self, state: ReqState) -> None:
        if state.wire_rid in self.states:
            raise invalid(f"rid {state.public_rid!r} is already in flight; request ids must be unique")
        self.states[state.wire_rid] = state
        state.call.states.append(state)

    def _send(self, state: ReqState) -> None:
        field = "embed" if state.kind is ReqKind.EMBED else "generate"
        if not state.conn.send(scheduler_pb2.SchedulerInput(**{field: state.req})):
            self._reroute_or_fail(state, f"scheduler {state.conn.address} is not connected")

    def _pop(self, state: ReqState) -> None:
        state.finished = True
        if self.states.get(state.wire_rid) is state:
            del self.states[state.wire_rid]

    def _fail(self, state: ReqState, error: ServiceError) -> None:
        if not state.finished:
            self._pop(state)
            state.call.queue.put_nowait(ErrorEvent(state, error))

    def _reroute_or_fail(self, state: ReqState, why: str) -> None:
        """Retry once on another scheduler if nothing was produced yet, else UNAVAILABLE."""
        others = [i for i in self.schedulers.connected() if self.schedulers.get(i) is not state.conn]
        if state.produced or state.retried or state.session_id or not others:
            self._fail(state, ServiceError(grpc.StatusCode.UNAVAILABLE, why))
            return
        conn = self.schedulers.get(self.router.choose(others, self._load_of))
        self._pop(state)
        state.finished = False
        state.wire_rid = state.req.rid = f"{state.public_rid}_retry"
        state.conn, state.retried = conn, True
        self.states[state.wire_rid] = state
        logger.warning("%s; retrying %s on scheduler %s", why, state.public_rid, conn.address)
        self._send(state)

    def _open_call(self, rid: str) -> Call:
        call = Call(rid)
        self.calls.add(call)
        self._idle.clear()
        return call

    def _close_call(self, call: Call, message: str) -> None:
        """Abort what is unfinished (at its scheduler, at once) and forget the call."""
        for state in call.states:
            if not state.finished:
                self._pop(state)
                state.conn.send(_abort_msg(state.wire_rid, message))
                if state.kind is not ReqKind.WARMUP:
                    self.metrics.num_aborted_requests.inc()
        self.calls.discard(call)
        if not self.calls:
            self._idle.set()

    async def _next_event(self, call: Call) -> Event:
        try:
            return await asyncio.wait_for(call.queue.get(), self.config.request_timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request {call.rid}: no output for request_timeout_s={self.config.request_timeout_s:g}s",
            ) from None

    # ---- Generate -------------------------------------------------------------------------
    async def generate(self, request: tokenizer_pb2.GenerateRequest) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        """Deltas (stream) or, per index, the whole output when it finishes (non-stream)."""
        self.check_accepting()
        self._check_model_kind(generation=True)
        tok = self._tok()
        rid = request.rid or new_rid()
        rid_token = request_id_var.set(rid)
        gen_span = start_span(
            "generate",
            request.trace.traceparent,
            request.trace.tracestate,
            attributes={"meshlm.rid": rid, "meshlm.stream": request.stream},
        )
        tp, ts = current_traceparent(gen_span)
        trace_ctx = common_pb2.TraceContext(
            traceparent=tp or request.trace.traceparent, tracestate=ts or request.trace.tracestate
        )
        call: Call | None = None
        end_message = "finished"
        try:
            with span("tokenize", trace_ctx.traceparent, trace_ctx.tracestate):
                try:
                    norm = normalize_generate(
                        request,
                        tok,
                        origin=self.origin,
                        vocab_size=self.vocab_size(),
                        max_input_len=self.max_input_len(),
                        trace=trace_ctx,
                        rid=rid,
                        warmup=self.config.parallel_sample_warmup,
                    )
                except InvalidRequest as e:
                    raise invalid(str(e)) from e
            self._admit(len(norm.subs) + len(norm.warmups))
            await self._wait_ring()
            call = self._open_call(rid)
            conns = {p.index: self.route(request.session_id) for p in norm.prompts}
            if norm.warmups:
                warm = [ReqState(call, -1, w.rid, w.req, conns[w.prompt_index], ReqKind.WARMUP) for w in norm.warmups]
                await self._run_warmups(call, warm)
            samples = [ReqState(call, s.index, s.rid, s.req, conns[s.prompt_index]) for s in norm.subs]
            for state in samples:
                self._register(state)
            for state in samples:
                self._send(state)
            pending = set(samples)
            while pending:
                event = await self._next_event(call)
                if isinstance(event, ErrorEvent):
                    raise event.error
                assert isinstance(event, DeltaEvent)
                state, delta = event.state, event.delta
                if delta.finish is not None and delta.finish.is_abort:
                    raise error_from_finish(state.public_rid, delta.finish)
                if delta.logprobs is not None and not request.return_text_in_logprobs:
                    strip_logprob_text(delta.logprobs)
                if request.stream:
                    yield self._response(state, delta.text, delta.ids, delta.logprobs, delta.finish)
                else:
                    state.text_parts.append(delta.text)
                    state.all_ids.extend(delta.ids)
                    if delta.logprobs is not None:
                        state.logprobs.MergeFrom(delta.logprobs)
                    if delta.finish is not None:
                        yield self._response(
                            state, "".join(state.text_parts), state.all_ids, state.logprobs, delta.finish
                        )
                if delta.finish is not None:
                    pending.discard(state)
        except ServiceError as e:
            end_message = f"{e.code.name}: {e.message}"
            gen_span.set_attribute("meshlm.error", end_message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            end_message = "cancelled by the caller"
            raise
        finally:
            if call is not None:
                self._close_call(call, end_message)
            gen_span.end()
            with contextlib.suppress(ValueError):  # closed from another context
                request_id_var.reset(rid_token)

    async def _run_warmups(self, call: Call, warm: list[ReqState]) -> None:
        for state in warm:
            self._register(state)
        for state in warm:
            self._send(state)
        pending = set(warm)
        while pending:
            event = await self._next_event(call)
            if isinstance(event, ErrorEvent):
                raise event.error
            assert isinstance(event, DeltaEvent)
            finish = event.delta.finish
            if finish is not None:
                if finish.is_abort:
                    raise error_from_finish(event.state.public_rid, finish)
                pending.discard(event.state)

    def _response(
        self,
        state: ReqState,
        text: str,
        ids: list[int],
        logprobs: common_pb2.LogprobDelta | None,
        finish: FinishReason | None,
    ) -> tokenizer_pb2.GenerateResponse:
        meta = tokenizer_pb2.MetaInfo(
            id=state.public_rid,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=state.cached_tokens,
            retractions=state.retractions,
        )
        if logprobs is not None and logprobs.ByteSize():
            meta.logprobs.CopyFrom(logprobs)
        if finish is not None:
            meta.finish_reason.CopyFrom(finish.to_proto())
            meta.e2e_latency = time.monotonic() - state.call.started
        return tokenizer_pb2.GenerateResponse(
            index=state.index, text=text, output_ids=ids, meta_info=meta, finished=finish is not None
        )

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
                self._observe_tokens(state, len(delta.ids), now)
            if delta.finish is not None:
                self._pop(state)
                if state.kind is ReqKind.GENERATE:
                    self._observe_finish(state, delta.finish, now)
            state.call.queue.put_nowait(DeltaEvent(state, delta))

    def _embed_rejected(self, state: ReqState, d: detokenizer_pb2.TextDelta) -> None:
        """The scheduler loop rejects an embedding request (bad input, queue full) with a token
        delta that finishes it with ABORT; anything else for an Embed prompt is ignored."""
        finish = FinishReason.from_proto(d.finish_reason)
        if finish is not None and finish.is_abort:
            self._pop(state)
            state.call.queue.put_nowait(EmbeddingEvent(state, [], finish))

    def on_batch_embedding_out(self, batch: scheduler_pb2.BatchEmbeddingOut) -> None:
        for result in batch.results:
            state = self.states.get(result.rid)
            if state is None or state.kind is not ReqKind.EMBED:
                continue
            state.prompt_tokens = result.prompt_tokens
            state.produced = True
            self._pop(state)
            finish = FinishReason.from_proto(result.finish_reason)
            state.call.queue.put_nowait(EmbeddingEvent(state, list(result.embedding), finish))

    def _observe_tokens(self, state: ReqState, num_ids: int, now: float) -> None:
        if state.first_at is None:
            state.first_at = now
            self.metrics.time_to_first_token.observe(now - state.call.started)
        elif num_ids:
            self.metrics.observe_inter_token(now - (state.last_at or now), num_ids)
        if num_ids:
            state.last_at = now

    def _observe_finish(self, state: ReqState, finish: FinishReason, now: float) -> None:
        self.metrics.num_requests.inc()
        self.metrics.e2e_request_latency.observe(now - state.call.started)
        self.metrics.prompt_tokens.inc(state.prompt_tokens)
        self.metrics.generation_tokens.inc(state.completion_tokens)
        if finish.is_abort:
            self.metrics.num_aborted_requests.inc()

    # ---- scheduler stream events (scheduler_client.SchedulerEvents) -----------------------
    def on_scheduler_connected(self, conn: SchedulerConnection) -> None:
        # (Re)connected: the model may have changed with the scheduler; refresh the cache.
        self._bg = [t for t in self._bg if not t.done()]
        self._bg.append(asyncio.create_task(self.control.refresh_model_info()))

    def on_scheduler_load(self, conn: SchedulerConnection) -> None:
        self.router.on_load(conn.index)

    def on_scheduler_error(self, conn: SchedulerConnection, error: scheduler_pb2.RequestError) -> None:
        state = self.states.get(error.rid)
        if state is None:
            return
        reason = error_reason(error)
        others = [i for i in self.schedulers.connected() if self.schedulers.get(i) is not conn]
        if reason.status_code == 503 and not state.produced and not state.retried and others and not state.session_id:
            # The scheduler is draining or without a detokenizer: another one may take it.
            self._reroute_or_fail(state, f"scheduler {conn.address} refused {state.public_rid}: {reason.message}")
            return
        self._pop(state)
        if state.kind is ReqKind.EMBED:
            state.call.queue.put_nowait(EmbeddingEvent(state, [], reason))
            return
        if state.kind is ReqKind.GENERATE:
            self._observe_finish(state, reason, time.monotonic())
        state.call.queue.put_nowait(DeltaEvent(state, Delta("", [], None, reason)))

    def on_scheduler_lost(self, conn: SchedulerConnection, reason: str) -> None:
        for state in [s for s in self.states.values() if s.conn is conn]:
            self._reroute_or_fail(state, f"scheduler {conn.address} connection lost ({reason})")

    # ---- Embed ----------------------------------------------------------------------------
    async def embed(self, request: tokenizer_pb2.EmbedRequest) -> tokenizer_pb2.EmbedResponse:
        self.check_accepting()
        self._check_model_kind(generation=False)
        tok = self._tok()
        rid = request.rid or new_rid()
        rid_token = request_id_var.set(rid)
        call: Call | None = None
        end_message = "finished"
        try:
            with span("tokenize", request.trace.traceparent, request.trace.tracestate) as s:
                tp, ts = current_traceparent(s)
                trace_ctx = common_pb2.TraceContext(
                    traceparent=tp or request.trace.traceparent, tracestate=ts or request.trace.tracestate
                )
                try:
                    _, items = normalize_embed(
                        request,
                        tok,
                        origin=self.origin,
                        vocab_size=self.vocab_size(),
                        trace=trace_ctx,
                        max_input_len=self.max_input_len(),
                        rid=rid,
                    )
                except InvalidRequest as e:
                    raise invalid(str(e)) from e
            self._admit(len(items))
            await self._wait_ring()
            call = self._open_call(rid)
            states = [ReqState(call, index, sub_rid, req, self.route(), ReqKind.EMBED) for index, sub_rid, req in items]
            for state in states:
                self._register(state)
            for state in states:
                self._send(state)
            results: dict[int, tokenizer_pb2.EmbeddingResult] = {}
            while len(results) < len(states):
                event = await self._next_event(call)
                if isinstance(event, ErrorEvent):
                    raise event.error
                assert isinstance(event, EmbeddingEvent)
                state = event.state
                if event.finish is not None and event.finish.is_abort:
                    raise error_from_finish(state.public_rid, event.finish)
                results[state.index] = tokenizer_pb2.EmbeddingResult(
                    index=state.index, embedding=event.values, prompt_tokens=state.prompt_tokens
                )
            return tokenizer_pb2.EmbedResponse(results=[results[i] for i in sorted(results)])
        except ServiceError as e:
            end_message = f"{e.code.name}: {e.message}"
            raise
        except asyncio.CancelledError:
            end_message = "cancelled by the caller"
            raise
        finally:
            if call is not None:
                self._close_call(call, end_message)
            request_id_var.reset(rid_token)

    # ---- Abort, Tokenize, Detokenize ------------------------------------------------------
    def abort(self, rid: str, abort_all: bool = False) -> None:
        """Abort by rid (exact, or prefix `<rid>_`: a batch / n>1 request) or all of this
        replica's requests. A rid this replica does not hold goes to every scheduler (another
        replica may own it; the scheduler matches it)."""
        if abort_all:
            msg = scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(abort_all=True, message="abort_all"))
            for conn in self.schedulers.connections:
                conn.send(msg)
            return
        if not rid:
            raise invalid("rid is empty; give a request id or set abort_all")
        mine = [s for s in self.states.values() if s.public_rid == rid or s.public_rid.startswith(rid + "_")]
        for s in mine:
            s.conn.send(_abort_msg(s.wire_rid, "aborted by request"))
        if not mine:
            for conn in self.schedulers.connections:
                conn.send(_abort_msg(rid, "aborted by request"))

    def tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        tok = self._tok()
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            _, ids = tokenize_prompt(tok, request.prompt, "prompt", self.vocab_size(), add_special_tokens=add_special)
        except InvalidRequest as e:
            raise invalid(str(e)) from e
        info = self.model_info
        max_len = info.context_length if info is not None else tok.model_max_length
        return tokenizer_pb2.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=max_len)

    def detokenize(self, request: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
        tok = self._tok()
        try:
            check_token_ids(request.tokens, "tokens", tok.vocab_size)
        except InvalidRequest as e:
            raise invalid(str(e)) from e
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return tokenizer_pb2.DetokenizeResponse(text=tok.decode(list(request.tokens), skip_special_tokens=skip))

    # ---- control plane (control.py) -------------------------------------------------------
    async def get_model_info(self, refresh: bool = False) -> common_pb2.ModelInfo:
        return await self.control.get_model_info(refresh)

    async def get_server_info(self) -> tokenizer_pb2.ServerInfo:
        return await self.control.get_server_info()

    async def flush_cache(self) -> tokenizer_pb2.FlushCacheResponse:
        return await self.control.flush_cache()

    async def open_session(self, request: tokenizer_pb2.OpenSessionRequest) -> str:
        return await self.control.open_session(request)

    async def close_session(self, session_id: str) -> None:
        await self.control.close_session(session_id)
