"""DecodeAdmission: the decode half of PD disaggregation (`--disaggregation-mode decode`; a
unified scheduler accepts handed-over requests as well).

`handle_prefilled_request` checks a PrefilledReq like any generate request, plus its KV's
shape, and queues it on `state.transfer_queue`. `admit_transferred`, run before each
scheduling decision, gives queued requests a row and KV slots (when the pool and
max_running_requests allow), writes the received KV, and merges them into the running batch as
if their prefill had just run here; their first token is emitted at once. A transferred
request that is later retracted is prefilled again locally, from prompt + outputs, like any
retracted request.

KV ownership after admission follows ScheduleBatch's rule: the prompt's slots are in the
prefix cache (locked by the request) or owned by the request (the unaligned tail), exactly as
after a local prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from meshlm.common.finish import FinishReason
from meshlm.scheduler.managers.grammar_manager import GrammarManager
from meshlm.scheduler.managers.io_struct import PrefilledReq
from meshlm.scheduler.managers.output_processor import OutputProcessor
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.request_checks import RequestValidator
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_state import PendingTransfer, SchedulerState

logger = logging.getLogger(__name__)


class DecodeAdmission:
    def __init__(
        self,
        prefill_role: bool,
        page_size: int,
        validator: RequestValidator,
        memory: SchedulerMemory,
        state: SchedulerState,
        output: OutputProcessor,
        grammar: GrammarManager,
    ) -> None:
        """prefill_role: this scheduler is a prefill scheduler, which refuses handed-over requests;
        grammar: a constrained request waits there for its matcher, which is then fed the
        prefill side's first token."""
        self.prefill_role = prefill_role
        self.page_size = page_size
        self.validator = validator
        self.memory = memory
        self.state = state
        self.output = output
        self.grammar = grammar

    def handle_prefilled_request(self, msg: PrefilledReq) -> None:
        """Check a handed-over request like a new one, plus its KV's shape; queue it."""
        req = self.validator.new_req(msg.req, list(msg.req.input_ids))
        req.output_ids = list(msg.output_ids)
        error = self.validator.validate(req) or self._check_prefilled(msg)
        if error is None and self.prefill_role:
            error = "a prefill scheduler does not accept prefilled requests"
        if error is not None:
            req.output_ids = []
            return self.output.reject(req, error)
        req.cached_tokens = msg.cached_tokens
        req.input_logprobs_done = True
        req.input_token_logprobs = list(msg.input_token_logprobs)
        req.input_top_logprobs = list(msg.input_top_logprobs)
        req.input_token_ids_logprobs = list(msg.input_token_ids_logprobs)
        req.output_token_logprobs = list(msg.output_token_logprobs)
        req.output_top_logprobs = list(msg.output_top_logprobs)
        req.output_token_ids_logprobs = list(msg.output_token_ids_logprobs)
        pending = PendingTransfer(req, msg.kv)

        def continue_grammar(r: Req) -> None:
            """The matcher continues after the prefill side's first token."""
            assert r.grammar is not None
            if not r.grammar.accept_token(r.output_ids[0]):
                r.output_ids = []
                return self.output.reject(r, "output_ids: the prefilled first token is not allowed by the grammar")
            self.state.transfer_queue.append(pending)

        if not self.grammar.process_req_with_grammar(req, continue_grammar):
            self.state.transfer_queue.append(pending)

    def _check_prefilled(self, msg: PrefilledReq) -> str | None:
        pool = self.memory.kv_pool
        vocab = self.memory.vocab_size
        want = (pool.layer_num, 2, len(msg.req.input_ids), pool.head_num, pool.head_dim)
        kv = msg.kv
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            return f"kv must have shape [layers, 2, input_len, kv_heads, head_dim] = {list(want)}, got {got}"
        if kv.dtype != pool.dtype:
            return f"kv dtype must be {pool.dtype} (this scheduler's KV dtype), got {kv.dtype}"
        if len(msg.output_ids) != 1:
            return f"output_ids must hold exactly the first sampled token, got {len(msg.output_ids)} tokens"
        if not 0 <= msg.output_ids[0] < vocab:
            return f"output_ids must be token ids in [0, {vocab})"
        if (msg.req.sampling_params.max_new_tokens or 0) < 1:
            return "max_new_tokens of a prefilled request must be >= 1"
        return None

    def admit_transferred(self) -> None:
        """Admit queued transferred requests, in order, while a row, their prompt's KV slots
        (+ one page for the next token) and a running slot are free."""
        queue, page = self.state.transfer_queue, self.page_size
        budget = self.memory.reusable_tokens()
        rows = self.memory.req_to_token_pool.available_size()
        room = self.memory.max_running_requests - len(self.state.running_batch.reqs)
        admitted: list[PendingTransfer] = []
        while queue and len(admitted) < min(rows, room):
            need = -(-len(queue[0].req.origin_input_ids) // page) * page + page  # whole pages + 1
            if need > budget:
                break
            budget -= need
            admitted.append(queue.popleft())
        if not admitted:
            return
        reqs = [t.req for t in admitted]
        for req in reqs:
            req.fill_ids = list(req.origin_input_ids)  # the KV received covers the prompt
        batch = self.memory.new_batch(reqs)
        fb = batch.prepare_for_extend()  # rows, slots and sampling rows; the forward is not run
        assert fb.out_cache_loc is not None
        pool, start = self.memory.kv_pool, 0
        for req, kv in admitted:
            n = len(req.origin_input_ids)
            loc = fb.out_cache_loc[start : start + n]  # this request's slots, in prompt order
            start += n
            kv = kv.to(pool.device)
            for layer in range(pool.layer_num):
                pool.set_kv_buffer(layer, loc, kv[layer, 0], kv[layer, 1])
            self.memory.tree_cache.cache_unfinished_req(req)
        self.state.running_batch.merge_batch(batch)
        self.output.stream_output(reqs)
        logger.debug("admitted %d transferred requests", len(reqs))

    def abort_transferred(self, hit: Callable[[str], bool], reason: FinishReason) -> None:
        """Abort queued transferred requests whose rid `hit` matches (they hold no KV yet)."""
        queue = self.state.transfer_queue
        for item in [t for t in queue if hit(t.req.rid)]:
            queue.remove(item)
            self.output.abort(item.req, reason)
