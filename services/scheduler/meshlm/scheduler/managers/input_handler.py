"""InputHandler: what the scheduler loop does with each input message (SGLang's
Scheduler.process_input_requests and handle_*_request): request checks that name the field and
the limit, sessions, aborts wherever a request is, cache flushes, load reports.

Every message ends in a queued request, an emitted error, or a control reply on the port.
Runs on the loop thread, between two steps.
"""

from __future__ import annotations

import logging

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.scheduler.disaggregation.decode import DecodeAdmission
from meshlm.scheduler.managers.grammar_manager import GrammarManager
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    CloseSessionReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    InputMessage,
    LoadReport,
    OpenSessionReq,
    PrefilledReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.managers.output_processor import OutputProcessor
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.request_checks import RequestValidator
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_state import SchedulerState
from meshlm.scheduler.managers.scheduler_stats import SchedulerStats
from meshlm.scheduler.managers.session_controller import SessionController

logger = logging.getLogger(__name__)


class InputHandler:
    def __init__(
        self,
        *,
        port: SchedulerPort,
        is_embedding_model: bool,
        max_queued_requests: int | None,
        validator: RequestValidator,
        sessions: SessionController,
        state: SchedulerState,
        memory: SchedulerMemory,
        output: OutputProcessor,
        grammar: GrammarManager,
        decode_side: DecodeAdmission,
        stats: SchedulerStats,
    ) -> None:
        """max_queued_requests: refuse new requests while this many wait (None: no cap)."""
        self.port = port
        self.is_embedding_model = is_embedding_model
        self.max_queued_requests = max_queued_requests
        self.validator = validator
        self.sessions = sessions
        self.state = state
        self.memory = memory
        self.output = output
        self.grammar = grammar
        self.decode_side = decode_side
        self.stats = stats

    def process_input_requests(self, msgs: list[InputMessage]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, PrefilledReq):
                self.decode_side.handle_prefilled_request(msg)
            elif isinstance(msg, TokenizedEmbeddingReqInput):
                self.handle_embedding_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg)
            elif isinstance(msg, FlushCacheReq):
                out = self.flush_cache()
                out.call_id = msg.call_id
                self.port.send_control(out)
            elif isinstance(msg, GetLoadReq):
                load = self.get_load()
                load.call_id = msg.call_id
                self.port.send_control(load)
            elif isinstance(msg, OpenSessionReq):
                self.port.send_control(self.sessions.open(msg))
            elif isinstance(msg, CloseSessionReq):
                self.port.send_control(self.sessions.close(msg))
            else:
                logger.error("scheduler got an unknown message %r", type(msg).__name__)

    def _queue_full(self) -> str | None:
        """Why a new request is refused (its message names the limit), or None when it fits.
        Waiting requests that the free running slots will take are about to run, not queued:
        only the rest count against max_queued_requests, so requests that arrive together at a
        server with free slots all run (the backlog stays <= the cap + max_running_requests)."""
        cap = self.max_queued_requests
        if cap is None:
            return None
        state = self.state
        running = len(state.running_reqs()) + (state.chunked_req is not None)
        free_slots = max(0, self.memory.max_running_requests - running)
        queued = max(0, len(state.waiting_queue) - free_slots)
        if queued < cap:
            return None
        return f"The request queue is full ({queued} waiting, max_queued_requests={cap}); retry later."

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        input_ids, session_error = recv.input_ids, None
        if recv.session_id is not None:
            input_ids, session_error = self.sessions.resolve_input(recv)
        req = self.validator.new_req(recv, input_ids)
        if session_error is not None:
            return self.output.reject(req, *session_error)
        error = self.validator.validate(req)
        if error is None and recv.session_id is not None:
            error = self.sessions.check_capacity(req)
        if error is not None:
            return self.output.reject(req, error)
        if self.is_embedding_model:
            return self.output.reject(req, "this model is an embedding model; it cannot generate")
        if (full := self._queue_full()) is not None:
            return self.output.reject(req, full, AbortStatus.UNAVAILABLE)

        def enqueue(admitted: Req) -> None:
            if recv.session_id is not None:
                self.sessions.add_req(recv, admitted)
            self.state.waiting_queue.append(admitted)

        # A constrained request first waits in the grammar queue for its grammar.
        if not self.grammar.process_req_with_grammar(req, enqueue):
            enqueue(req)

    def handle_embedding_request(self, recv: TokenizedEmbeddingReqInput) -> None:
        req = self.validator.new_embedding_req(recv.rid, recv.input_ids, recv.input_text)
        error = self.validator.validate_embedding(req)
        if error is not None:
            return self.output.reject(req, error)
        if (full := self._queue_full()) is not None:
            return self.output.reject(req, full, AbortStatus.UNAVAILABLE)
        self.state.waiting_queue.append(req)

    def abort_request(self, abort: AbortReq) -> None:
        """Abort matching requests wherever they are; their KV is released at once."""

        def hit(rid: str) -> bool:
            return abort.abort_all or rid == abort.rid or rid.startswith(abort.rid + "_")

        state, tree_cache = self.state, self.memory.tree_cache
        reason = FinishReason.aborted(abort.message, AbortStatus.CANCELLED)
        self.decode_side.abort_transferred(hit, reason)
        self.grammar.abort(hit, reason)
        for req in [r for r in state.waiting_queue if hit(r.rid)]:
            state.waiting_queue.remove(req)  # waiting requests hold no KV and no locks
            self.output.abort(req, reason)
        chunked = state.chunked_req
        if chunked is not None and hit(chunked.rid):
            state.chunked_req = None
            tree_cache.release_req(chunked, len(chunked.fill_ids))
            self.output.abort(chunked, reason)
        for req in list(state.running_batch.reqs) + state.last_prefilled():
            if hit(req.rid) and not req.finished():
                req.finished_reason = reason
                tree_cache.cache_finished_req(req)
                self.output.stream_output([req])

    def flush_cache(self) -> FlushCacheOutput:
        """Drop every cached prefix; refused while a live request holds KV slots or a row."""
        if self.state.has_live_requests():
            return FlushCacheOutput(False, "Cache not flushed: requests are running or waiting.")
        self.memory.flush()
        return FlushCacheOutput(True, "Cache flushed.")

    def get_load(self) -> LoadReport:
        state, memory = self.state, self.memory
        used = memory.num_used_tokens()
        return LoadReport(
            num_running_reqs=len(state.running_reqs()),
            num_queue_reqs=len(state.waiting_queue) + len(state.transfer_queue),
            num_used_tokens=used,
            max_total_num_tokens=memory.max_total_num_tokens,
            cache_hit_rate=self.stats.cache_hit_rate(),
            token_usage=used / memory.max_total_num_tokens,
            max_running_requests=memory.max_running_requests,
            num_retracted_reqs=sum(r.retraction_count > 0 for r in state.waiting_queue),
            num_grammar_queue_reqs=len(self.grammar),
        )
