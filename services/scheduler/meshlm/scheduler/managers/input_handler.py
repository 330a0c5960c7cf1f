"""SchedulerInputMixin: what the scheduler loop does with each input message (SGLang's
Scheduler.process_input_requests and handle_*_request): request checks that name the field and
the limit, aborts wherever a request is, cache flushes, load reports.

Mixed into Scheduler (managers/scheduler.py), which owns the queues, pools and caches used here;
everything runs on the loop thread.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

import torch

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    CloseSessionReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    LoadReport,
    OpenSessionReq,
    PrefilledReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode
from meshlm.scheduler.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from meshlm.scheduler.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class SchedulerInputMixin:
    config: Any
    model_config: Any
    tokenizer: Any
    port: Any
    tree_cache: Any
    allocator: Any
    req_to_token_pool: Any
    sessions: Any
    stats: Any
    waiting_queue: list[Req]
    transfer_queue: "deque[tuple[Req, torch.Tensor]]"
    chunked_req: Optional[Req]
    running_batch: "ScheduleBatch"
    last_batch: Optional["ScheduleBatch"]
    max_req_len: int
    max_total_num_tokens: int
    max_running_requests: int
    handle_prefilled_request: Any
    abort_transferred: Any
    stream_output: Any

    # ---- inputs ---------------------------------------------------------------------------
    def process_input_requests(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, PrefilledReq):
                self.handle_prefilled_request(msg)
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

    def _reject(self, req: Req, message: str, status_code: int = AbortStatus.BAD_REQUEST) -> None:
        req.finished_reason = FinishReason.aborted(message, status_code)
        self.stream_output([req])

    def _queue_full(self) -> bool:
        cap = self.config.max_queued_requests
        return cap is not None and len(self.waiting_queue) >= cap

    def new_req(self, recv: TokenizedGenerateReqInput, input_ids: list[int]) -> Req:
        return Req(
            recv.rid, input_ids, recv.sampling_params,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob,
            stream=recv.stream,
            origin_input_text=recv.input_text,
            session_id=recv.session_id,
        )

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        input_ids, session_error = recv.input_ids, None
        if recv.session_id is not None:
            input_ids, session_error = self.sessions.resolve_input(recv)
        req = self.new_req(recv, input_ids)
        if session_error is not None:
            return self._reject(req, *session_error)
        error = self._validate(req)
        if error is None and recv.session_id is not None:
            error = self.sessions.check_capacity(req)
        if error is not None:
            return self._reject(req, error)
        if self.model_config.is_embedding:
            return self._reject(req, "this model is an embedding model; it cannot generate")
        if self._queue_full():
            return self._reject(req, "The request queue is full.", AbortStatus.UNAVAILABLE)
        if recv.session_id is not None:
            self.sessions.add_req(recv, req)
        self.waiting_queue.append(req)

    def _too_long(self, n: int) -> str:
        """The error for an input of n > max_req_len tokens; names the input length, the
        model's context length and the most input tokens a request may hold."""
        return (
            f"The input ({n} tokens) is longer than the model's context length "
            f"({self.model_config.context_len} tokens; a request may hold at most {self.max_req_len} input tokens)."
        )

    def _validate(self, req: Req) -> Optional[str]:
        """SGLang's handle_generate_request checks; returns an error naming field and limit."""
        n = len(req.origin_input_ids)
        sp = req.sampling_params
        if n == 0:
            return "input_ids must not be empty"
        if n > self.max_req_len:
            return self._too_long(n)
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.origin_input_ids):
            return f"input_ids must be token ids in [0, {self.model_config.vocab_size})"
        try:
            sp.verify(self.model_config.vocab_size)
            sp.normalize(self.tokenizer)
        except ValueError as e:
            return str(e)
        if req.top_logprobs_num < 0:
            return f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
        for t in req.token_ids_logprob or ():
            if not 0 <= t < self.model_config.vocab_size:
                return f"token_ids_logprob must be in [0, {self.model_config.vocab_size}), got {t}"
        if req.return_logprob:
            if req.logprob_start_len == -1:
                req.logprob_start_len = n - 1
            if not 0 <= req.logprob_start_len < n:
                return f"logprob_start_len must be in [0, {n}) (the input length) or -1, got {req.logprob_start_len}"
        # Clamp max_new_tokens to what the context and the KV pool can hold.
        room = self.max_req_len - n
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        if sp.min_new_tokens > sp.max_new_tokens:
            sp.min_new_tokens = sp.max_new_tokens
        return None

    def handle_embedding_request(self, recv: TokenizedEmbeddingReqInput) -> None:
        sp = SamplingParams(max_new_tokens=0)
        req = Req(recv.rid, recv.input_ids, sp, is_embedding=True, origin_input_text=recv.input_text)
        n = len(req.origin_input_ids)
        if n == 0:
            return self._reject(req, "input must not be empty")
        if n > self.max_req_len:
            return self._reject(req, self._too_long(n))
        if self._queue_full():
            return self._reject(req, "The request queue is full.", AbortStatus.UNAVAILABLE)
        self.waiting_queue.append(req)

    def abort_request(self, abort: AbortReq) -> None:
        """Abort matching requests wherever they are; their KV is released at once."""

        def hit(rid: str) -> bool:
            return abort.abort_all or rid == abort.rid or rid.startswith(abort.rid + "_")

        reason = FinishReason.aborted(abort.message, AbortStatus.CANCELLED)
        self.abort_transferred(hit, reason)
        for req in [r for r in self.waiting_queue if hit(r.rid)]:
            self.waiting_queue.remove(req)  # waiting requests hold no KV and no locks
            req.finished_reason = reason
            self.stream_output([req])
        if self.chunked_req is not None and hit(self.chunked_req.rid):
            req, self.chunked_req = self.chunked_req, None
            self.tree_cache.release_req(req, len(req.fill_ids))
            req.finished_reason = reason
            self.stream_output([req])
        running = list(self.running_batch.reqs)
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            running += self.last_batch.sampling_reqs  # prefilled, not merged yet
        for req in running:
            if hit(req.rid) and not req.finished():
                req.finished_reason = reason
                self.tree_cache.cache_finished_req(req)
                self.stream_output([req])

    def has_live_requests(self) -> bool:
        """Whether any unfinished request is waiting, chunked, decoding or just prefilled (an
        EXTEND batch's requests join the running batch only at the next get_next_batch_to_run,
        and finished ones leave it only then)."""
        return bool(
            self.waiting_queue or self.transfer_queue or self.chunked_req is not None or self._running_reqs()
        )

    def _running_reqs(self) -> list[Req]:
        """Unfinished requests holding KV: decoding, or prefilled and not merged yet."""
        live = list(self.running_batch.reqs)
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            live += [r for r in self.last_batch.sampling_reqs if r not in self.running_batch.reqs]
        return [r for r in live if not r.finished()]

    def flush_cache(self) -> FlushCacheOutput:
        """Drop every cached prefix; refused while a live request holds KV slots or a row."""
        if self.has_live_requests():
            return FlushCacheOutput(False, "Cache not flushed: requests are running or waiting.")
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return FlushCacheOutput(True, "Cache flushed.")

    def get_load(self) -> LoadReport:
        used = self.num_used_tokens()
        return LoadReport(
            num_running_reqs=len(self._running_reqs()),
            num_queue_reqs=len(self.waiting_queue) + len(self.transfer_queue),
            num_used_tokens=used,
            max_total_num_tokens=self.max_total_num_tokens,
            cache_hit_rate=self.stats.cache_hit_rate(),
            token_usage=used / self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            num_retracted_reqs=sum(r.retraction_count > 0 for r in self.waiting_queue),
        )

    def num_used_tokens(self) -> int:
        """KV slots held by requests (not free and not merely cached for reuse)."""
        return self.max_total_num_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()
