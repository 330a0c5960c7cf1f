"""Prefill/decode disaggregation inside the scheduler loop (SGLang's disaggregation/
prefill.py and decode.py, over an in-memory handoff instead of an RDMA engine).

Prefill role (`--disaggregation-mode prefill`): a request runs its (chunked) prefill and
samples its first token as usual; then, unless it already finished, `transfer_prefilled`
copies the prompt's KV out of the pool, emits a PrefilledReq on the port and ends the request
here (`req.transferred`: finished, never emitted). Its KV stays in this scheduler's radix
cache, so later prompts sharing the prefix are computed once here too.

Decode role (`--disaggregation-mode decode`; a unified scheduler accepts them as well):
`handle_prefilled_request` validates a PrefilledReq like any generate request and queues it;
`admit_transferred`, run before each scheduling decision, gives queued requests a row and KV
slots (when the pool and max_running_requests allow), writes the received KV, and merges them
into the running batch as if their prefill had just run here. Their first token is emitted at
once. A transferred request that is later retracted is prefilled again locally, from prompt +
outputs, like any retracted request.

KV ownership on the decode side follows ScheduleBatch's rule: after admission the prompt's
slots are in the radix tree (locked by the request) or owned by the request (the unaligned
tail), exactly as after a local prefill.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

import torch

from meshlm.scheduler.managers.io_struct import PrefilledReq, TokenizedGenerateReqInput
from meshlm.scheduler.managers.req import Req

if TYPE_CHECKING:
    from meshlm.scheduler.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class DisaggregationMixin:
    """Both halves of PD disaggregation; mixed into Scheduler, which provides the pools."""

    config: Any
    model_config: Any
    port: Any
    tree_cache: Any
    allocator: Any
    req_to_token_pool: Any
    running_batch: "ScheduleBatch"
    max_running_requests: int
    transfer_queue: "deque[tuple[Req, torch.Tensor]]"

    # ---- prefill role ---------------------------------------------------------------------
    def should_transfer(self, req: Req) -> bool:
        """Whether a just-prefilled, unfinished request moves to a decode scheduler. Session
        turns stay here: the next turn needs this turn's outputs in this scheduler."""
        return self.config.disaggregation_mode == "prefill" and req.session_id is None

    def transfer_prefilled(self, req: Req) -> None:
        """Emit req's prompt KV + first token as a PrefilledReq and end it here.

        The KV of prompt positions 0..n-1 is read before cache_finished_req, which may free
        the request's duplicate slots of a prefix the tree already holds."""
        pool = self.token_to_kv_pool
        n = len(req.origin_input_ids)
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)
        kv = torch.stack([
            torch.stack([pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots]])
            for layer in range(pool.layer_num)
        ]).cpu()
        sp = copy.deepcopy(req.sampling_params)
        msg = PrefilledReq(
            req=TokenizedGenerateReqInput(
                rid=req.rid, input_ids=list(req.origin_input_ids), sampling_params=sp,
                input_text=req.origin_input_text, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                token_ids_logprob=req.token_ids_logprob, stream=req.stream,
            ),
            output_ids=list(req.output_ids),
            kv=kv,
            cached_tokens=req.cached_tokens,
            input_token_logprobs=list(req.input_token_logprobs),
            input_top_logprobs=list(req.input_top_logprobs),
            input_token_ids_logprobs=list(req.input_token_ids_logprobs),
            output_token_logprobs=list(req.output_token_logprobs),
            output_top_logprobs=list(req.output_top_logprobs),
            output_token_ids_logprobs=list(req.output_token_ids_logprobs),
        )
        req.transferred = True
        self.tree_cache.cache_finished_req(req)
        self.port.send_output(msg)

    @property
    def token_to_kv_pool(self) -> Any:
        return self.tp_worker.model_runner.token_to_kv_pool  # type: ignore[attr-defined]

    # ---- decode role ----------------------------------------------------------------------
    def handle_prefilled_request(self, msg: PrefilledReq) -> None:
        """Check a handed-over request like a new one, plus its KV's shape; queue it."""
        req = self.new_req(msg.req, list(msg.req.input_ids))  # type: ignore[attr-defined]
        req.output_ids = list(msg.output_ids)
        error = self._validate(req) or self._check_prefilled(msg)  # type: ignore[attr-defined]
        if error is None and self.config.disaggregation_mode == "prefill":
            error = "a prefill scheduler does not accept prefilled requests"
        if error is not None:
            req.output_ids = []
            return self._reject(req, error)  # type: ignore[attr-defined]
        req.cached_tokens = msg.cached_tokens
        req.input_logprobs_done = True
        req.input_token_logprobs = list(msg.input_token_logprobs)
        req.input_top_logprobs = list(msg.input_top_logprobs)
        req.input_token_ids_logprobs = list(msg.input_token_ids_logprobs)
        req.output_token_logprobs = list(msg.output_token_logprobs)
        req.output_top_logprobs = list(msg.output_top_logprobs)
        req.output_token_ids_logprobs = list(msg.output_token_ids_logprobs)
        self.transfer_queue.append((req, msg.kv))

    def _check_prefilled(self, msg: PrefilledReq) -> Optional[str]:
        pool = self.token_to_kv_pool
        want = (pool.layer_num, 2, len(msg.req.input_ids), pool.head_num, pool.head_dim)
        kv = msg.kv
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            return f"kv must have shape [layers, 2, input_len, kv_heads, head_dim] = {list(want)}, got {got}"
        if kv.dtype != pool.dtype:
            return f"kv dtype must be {pool.dtype} (this scheduler's KV dtype), got {kv.dtype}"
        if len(msg.output_ids) != 1:
            return f"output_ids must hold exactly the first sampled token, got {len(msg.output_ids)} tokens"
        if not 0 <= msg.output_ids[0] < self.model_config.vocab_size:
            return f"output_ids must be token ids in [0, {self.model_config.vocab_size})"
        if (msg.req.sampling_params.max_new_tokens or 0) < 1:
            return "max_new_tokens of a prefilled request must be >= 1"
        return None

    def admit_transferred(self) -> None:
        """Admit queued transferred requests, in order, while a row, their prompt's KV slots
        (+ one page for the next token) and a running slot are free."""
        page = self.config.page_size
        budget = self.allocator.available_size() + self.tree_cache.evictable_size()
        rows = self.req_to_token_pool.available_size()
        room = self.max_running_requests - len(self.running_batch.reqs)
        admitted: list[tuple[Req, torch.Tensor]] = []
        while self.transfer_queue and len(admitted) < min(rows, room):
            req, kv = self.transfer_queue[0]
            need = -(-len(req.origin_input_ids) // page) * page + page
            if need > budget:
                break
            budget -= need
            admitted.append(self.transfer_queue.popleft())
        if not admitted:
            return
        reqs = [r for r, _ in admitted]
        for req in reqs:
            req.fill_ids = list(req.origin_input_ids)  # the KV received covers the prompt
        batch = self._new_batch(reqs)  # type: ignore[attr-defined]
        fb = batch.prepare_for_extend()  # rows, slots and sampling rows; the forward is not run
        pool, start = self.token_to_kv_pool, 0
        for req, kv in admitted:
            n = len(req.origin_input_ids)
            loc = fb.out_cache_loc[start : start + n]  # this request's slots, in prompt order
            start += n
            kv = kv.to(pool.device)
            for layer in range(pool.layer_num):
                pool.set_kv_buffer(layer, loc, kv[layer, 0], kv[layer, 1])
            self.tree_cache.cache_unfinished_req(req)
        self.running_batch.merge_batch(batch)
        self.stream_output(reqs)  # type: ignore[attr-defined]
        logger.debug("admitted %d transferred requests", len(reqs))

    def abort_transferred(self, hit: Any, reason: Any) -> None:
        """Abort queued transferred requests matching `hit` (they hold no KV yet)."""
        for item in [x for x in self.transfer_queue if hit(x[0].rid)]:
            self.transfer_queue.remove(item)
            item[0].finished_reason = reason
            self.stream_output([item[0]])  # type: ignore[attr-defined]
