"""PrefillHandoff: the prefill half of PD disaggregation (`--disaggregation-mode prefill`).

A request runs its (chunked) prefill and samples its first token as usual; then, unless it
already finished, `transfer_prefilled` copies the prompt's KV out of the pool, emits a
PrefilledReq on the port and ends the request here (`req.transferred`: finished, never
emitted). Its KV stays in this scheduler's prefix cache, so later prompts sharing the prefix
are computed once here too. Session turns are never handed over: the next turn needs this
turn's outputs in this scheduler; nor are migrated requests (they arrive with outputs already).
"""

from __future__ import annotations

import copy

import torch

from meshlm.scheduler.managers.io_struct import PrefilledReq, TokenizedGenerateReqInput
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory


class PrefillHandoff:
    def __init__(self, enabled: bool, memory: SchedulerMemory, port: SchedulerPort) -> None:
        """enabled: this scheduler has the prefill role (otherwise nothing is handed over)."""
        self.enabled = enabled
        self.memory = memory
        self.port = port

    def should_transfer(self, req: Req) -> bool:
        """Whether a just-prefilled, unfinished request moves to a decode scheduler. A migrated
        request (its decode scheduler was lost, docs/ring.md "Request migration") decodes here:
        a handover carries exactly one output token."""
        return self.enabled and req.session_id is None and not req.resumed_tokens

    def transfer_prefilled(self, req: Req) -> None:
        """Emit req's prompt KV + first token as a PrefilledReq and end it here.

        The KV of prompt positions 0..n-1 is read before cache_finished_req, which may free
        the request's duplicate slots of a prefix the tree already holds."""
        pool = self.memory.kv_pool
        n = len(req.origin_input_ids)
        assert req.req_pool_idx is not None
        slots = self.memory.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)
        kv = torch.stack(
            [
                torch.stack([pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots]])
                for layer in range(pool.layer_num)
            ]
        ).cpu()
        msg = PrefilledReq(
            req=TokenizedGenerateReqInput(
                rid=req.rid,
                input_ids=list(req.origin_input_ids),
                sampling_params=copy.deepcopy(req.sampling_params),
                input_text=req.origin_input_text,
                return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len,
                top_logprobs_num=req.top_logprobs_num,
                token_ids_logprob=req.token_ids_logprob,
                stream=req.stream,
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
        self.memory.tree_cache.cache_finished_req(req)
        self.port.send_output(msg)
