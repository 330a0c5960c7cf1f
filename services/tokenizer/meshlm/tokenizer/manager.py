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

The requests in flight and what arrives for them are inflight.py's; choosing, sending to and
hearing from schedulers (with the one retry of a request whose scheduler is lost) dispatch.py's.

Errors are `ServiceError(grpc code, message)`; an ABORT finish maps its status_code through
FinishReason.grpc_code (meshlm.common.finish: 400 INVALID_ARGUMENT, 404 NOT_FOUND, 499/0
CANCELLED, 503 RESOURCE_EXHAUSTED, else INTERNAL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

import grpc

from meshlm.common.channels import Dialer
from meshlm.common.deadline import within
from meshlm.common.errors import ServiceError
from meshlm.common.metrics import Metrics
from meshlm.common.telemetry import current_traceparent, span, start_span
from meshlm.tokenizer import limits
from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.control import ControlPlane
from meshlm.tokenizer.detokenizer_client import DetokenizerPool
from meshlm.tokenizer.dispatch import Dispatcher
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.inflight import InFlight, abort_msg
from meshlm.tokenizer.metrics import TokenizerMetrics
from meshlm.tokenizer.request import (
    InvalidRequest,
    check_token_ids,
    new_rid,
    normalize_embed,
    normalize_generate,
    tokenize_prompt,
)
from meshlm.tokenizer.state import (
    Call,
    Delta,
    DeltaEvent,
    DirectDelivery,
    EmbeddingEvent,
    ErrorEvent,
    ReqKind,
    ReqState,
    error_from_finish,
    invalid,
    response_of,
    strip_logprob_text,
)
from meshlm.v1 import common_pb2, scheduler_pb2, tokenizer_pb2

logger = logging.getLogger(__name__)

# Takes a streaming request's response as soon as its delta is read (TokenizerManager.generate).
ResponseSink = Callable[[tokenizer_pb2.GenerateResponse], None]


def _direct_delivery(sink: ResponseSink, strip_text: bool) -> DirectDelivery:
    """A call's delivery of unfinished deltas to sink, as the generate loop would yield them."""

    def deliver(state: ReqState, delta: Delta) -> None:
        if strip_text and delta.logprobs is not None:
            strip_logprob_text(delta.logprobs)
        sink(response_of(state, delta.text, delta.ids, delta.logprobs, None))

    return deliver


class TokenizerManager:
    def __init__(
        self, config: TokenizerConfig, tokenizer: HFTokenizer | None = None, metrics: Metrics | None = None
    ) -> None:
        self.config = config
        self.origin = config.tokenizer_id
        self.tokenizer = tokenizer
        self.metrics = TokenizerMetrics(metrics)
        self.inflight = InFlight(self.metrics, config.request_timeout_s, config.max_stream_backlog_bytes)
        dialer = Dialer(config.tls, token=config.auth.internal_token_value)
        self.dispatch = Dispatcher(config, self.inflight, self._refresh_model_info, dialer=dialer)
        self.schedulers = self.dispatch.schedulers
        self.detokenizers = DetokenizerPool(
            config.detokenizer_addrs,
            self.origin,
            self.inflight.on_batch_str_out,
            self.inflight.on_batch_embedding_out,
            dialer=dialer,
        )
        self.control = ControlPlane(self)
        self.draining = False
        self._bg: list[asyncio.Task] = []

    @property
    def states(self) -> dict[str, ReqState]:
        """The requests in flight, by wire rid."""
        return self.inflight.states

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

    def _refresh_model_info(self) -> None:
        """After a scheduler (re)connects: the model may have changed with it."""
        self._bg = [t for t in self._bg if not t.done()]
        self._bg.append(asyncio.create_task(self.control.refresh_model_info()))

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
            await within(self.inflight.idle.wait(), max(0.0, grace_s))
            return
        except asyncio.TimeoutError:
            pass  # still busy: abort what is left
        err = ServiceError(grpc.StatusCode.UNAVAILABLE, "tokenizer is shutting down; request aborted")
        for state in list(self.states.values()):
            state.conn.send(abort_msg(state.wire_rid, "tokenizer shutting down"))
            self.inflight.fail(state, err)
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self.inflight.idle.wait(), 2.0)

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

    # ---- Generate -------------------------------------------------------------------------
    async def generate(
        self, request: tokenizer_pb2.GenerateRequest, sink: ResponseSink | None = None
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        """Deltas (stream) or, per index, the whole output when it finishes (non-stream).

        sink: for a streaming request, every response but each output's last is handed to it, from
        the callback that read the delta, instead of being yielded (one task wake-up and one
        generator step fewer per token: GenerateStream's streams); the last ones are yielded
        after it. Ignored for a non-streaming request."""
        self.check_accepting()
        self._check_model_kind(generation=True)
        tok = self._tok()
        rid = request.rid or new_rid()
        with self.inflight.scope(rid) as scope:
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
                call = scope.open()
                conns = {p.index: self.dispatch.route(request.session_id) for p in norm.prompts}
                if norm.warmups:
                    warm = [
                        ReqState(call, -1, w.rid, w.req, conns[w.prompt_index], ReqKind.WARMUP) for w in norm.warmups
                    ]
                    await self._run_warmups(call, warm)
                samples = [ReqState(call, s.index, s.rid, s.req, conns[s.prompt_index]) for s in norm.subs]
                if sink is not None and request.stream:
                    call.direct = _direct_delivery(sink, strip_text=not request.return_text_in_logprobs)
                self._submit(samples)
                pending = set(samples)
                while pending:
                    event = await self.inflight.next_event(call)
                    if isinstance(event, ErrorEvent):
                        raise event.error
                    assert isinstance(event, DeltaEvent)
                    state, delta = event.state, event.delta
                    if delta.finish is not None and delta.finish.is_abort:
                        raise error_from_finish(state.public_rid, delta.finish)
                    if delta.logprobs is not None and not request.return_text_in_logprobs:
                        strip_logprob_text(delta.logprobs)
                    if request.stream:
                        yield response_of(state, delta.text, delta.ids, delta.logprobs, delta.finish)
                    else:
                        state.text_parts.append(delta.text)
                        state.all_ids.extend(delta.ids)
                        if delta.logprobs is not None:
                            state.logprobs.MergeFrom(delta.logprobs)
                        if delta.finish is not None:
                            text = "".join(state.text_parts)
                            yield response_of(state, text, state.all_ids, state.logprobs, delta.finish)
                    if delta.finish is not None:
                        pending.discard(state)
            except ServiceError as e:
                gen_span.set_attribute("meshlm.error", f"{e.code.name}: {e.message}")
                raise
            finally:
                gen_span.end()

    def _submit(self, states: list[ReqState]) -> None:
        """Register every request before sending any (an early output must find its request)."""
        for state in states:
            self.inflight.register(state)
        for state in states:
            self.dispatch.send(state)

    async def _run_warmups(self, call: Call, warm: list[ReqState]) -> None:
        self._submit(warm)
        pending = set(warm)
        while pending:
            event = await self.inflight.next_event(call)
            if isinstance(event, ErrorEvent):
                raise event.error
            assert isinstance(event, DeltaEvent)
            finish = event.delta.finish
            if finish is not None:
                if finish.is_abort:
                    raise error_from_finish(event.state.public_rid, finish)
                pending.discard(event.state)

    # ---- Embed ----------------------------------------------------------------------------
    async def embed(self, request: tokenizer_pb2.EmbedRequest) -> tokenizer_pb2.EmbedResponse:
        self.check_accepting()
        self._check_model_kind(generation=False)
        tok = self._tok()
        rid = request.rid or new_rid()
        with self.inflight.scope(rid) as scope:
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
            call = scope.open()
            states = [
                ReqState(call, index, sub_rid, req, self.dispatch.route(), ReqKind.EMBED)
                for index, sub_rid, req in items
            ]
            self._submit(states)
            results: dict[int, tokenizer_pb2.EmbeddingResult] = {}
            while len(results) < len(states):
                event = await self.inflight.next_event(call)
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
        limits.check_id("rid", rid)
        mine = [s for s in self.states.values() if s.public_rid == rid or s.public_rid.startswith(rid + "_")]
        for s in mine:
            s.conn.send(abort_msg(s.wire_rid, "aborted by request"))
        if not mine:
            for conn in self.schedulers.connections:
                conn.send(abort_msg(rid, "aborted by request"))

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
            limits.check_detokenize(request)
            check_token_ids(request.tokens, "tokens", tok.vocab_size)
        except InvalidRequest as e:
            raise invalid(str(e)) from e
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return tokenizer_pb2.DetokenizeResponse(text=tok.decode(list(request.tokens), skip_special_tokens=skip))
