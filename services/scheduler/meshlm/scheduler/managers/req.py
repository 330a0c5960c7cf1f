"""Req: one generation or embedding request inside the scheduler.

Token bookkeeping (SGLang's Req):

    origin_input_ids   the prompt                                  [p0 .. p(n-1)]
    output_ids         generated so far                             [o0 .. o(m-1)]
    fill_ids           origin_input_ids + output_ids (what to prefill when (re)scheduled)
    prefix_indices     KV slots of fill_ids[:len(prefix_indices)] already cached (radix match
                       or earlier chunks); the request holds a lock on `last_node` for them
    extend_input_len   len(fill_ids) - len(prefix_indices): tokens this prefill computes

KV exists for every token except the newest output token, which is fed by the next decode.
"""

from __future__ import annotations

import time

import torch

from meshlm.common.finish import FinishReason
from meshlm.scheduler.constrained.base_grammar_backend import BaseGrammarObject
from meshlm.scheduler.managers.io_struct import ReqTimes
from meshlm.scheduler.mem_cache.radix_cache import TreeNode
from meshlm.scheduler.sampling.sampling_params import SamplingParams


class Req:
    """Mutable per-request state, owned by the scheduler thread alone."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        stream: bool = False,
        is_embedding: bool = False,
        origin_input_text: str | None = None,
        session_id: str | None = None,
    ) -> None:
        self.rid = rid
        self.session_id = session_id
        self.times = ReqTimes(arrival=time.time())
        self.origin_input_ids = list(origin_input_ids)
        self.origin_input_text = origin_input_text
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.stream = stream
        self.is_embedding = is_embedding
        # Stop tokens: the model's EOS ids unless ignore_eos, plus the request's stop_token_ids.
        stop = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            stop |= set(eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(stop)
        self.eos_token_ids = frozenset(eos_token_ids)
        # Constrained decoding: this request's matcher (GrammarManager sets it before the
        # request is queued); it has accepted exactly output_ids.
        self.grammar: BaseGrammarObject | None = None

        # Memory state.
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: TreeNode | None = None  # deepest node of the locked cached prefix
        self.extend_input_len = 0
        self.cache_protected_len = 0  # leading KV positions owned by the radix tree (locked)
        self.cached_tokens = 0  # prompt tokens served from the radix cache (reported to users)
        self.is_chunked = 0  # >0 while a chunked prefill of this request is in progress
        self.retraction_count = 0

        # Logprobs.
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob
        self.input_logprobs_done = False
        self.input_logprobs_sent = False
        self.input_token_logprobs: list[float | None] = []  # None: the first prompt token
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_ids_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_ids_logprobs: list[list[tuple[float, int]]] = []

        # Outputs. `transferred`: a prefill scheduler handed the request to a decode scheduler,
        # which finishes it; here it counts as finished but is never emitted.
        self.finished_reason: FinishReason | None = None
        self.transferred = False
        self.embedding: list[float] | None = None
        self.send_token_offset = 0
        self.send_logprob_offset = 0

    # ---- derived -------------------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None or self.transferred

    def init_next_round_input(self) -> None:
        """Prepare fill_ids for a (re)prefill. The prefix is matched by the scheduler's cache."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        """Forget all KV state; the request will be prefilled again from prompt + outputs."""
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.cache_protected_len = 0
        self.extend_input_len = 0
        self.is_chunked = 0
        self.req_pool_idx = None
        self.retraction_count += 1

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, out={len(self.output_ids)})"
