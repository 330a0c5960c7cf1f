"""ScheduleBatch: a set of requests scheduled together, and the memory bookkeeping of a step.

A request's KV positions 0 .. seqlen-2 are in the cache between steps; the newest output
token is the input of the next decode. Ownership of those slots:

    [0, cache_protected_len)        owned by the radix tree, locked through req.last_node
    [cache_protected_len, seqlen-1) owned by the request; freed or inserted when it ends

cache_protected_len is page-aligned, so a request's own slots start on a fresh page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from meshlm.scheduler.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
    from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache
    from meshlm.scheduler.mem_cache.memory_pool import ReqToTokenPool


class OutOfKVMemory(RuntimeError):
    """Raised when a step cannot get KV slots even after evicting the whole cache."""


class ScheduleBatch:
    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: BasePrefixCache,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.vocab_size = vocab_size
        self.device = device
        self.forward_mode = ForwardMode.IDLE
        self.sampling_info: SamplingBatchInfo | None = None
        # Requests of an EXTEND batch that sample this step (a non-final chunk does not).
        self.sampling_reqs: list[Req] = []
        # The forward prepared by prepare_for_extend / prepare_for_decode, run next.
        self.pending_fb: ForwardBatch | None = None
        # Requests of a MIXED batch that were decoding (mix_with_running): they take one
        # decode step here and are not prefills.
        self.decoding_reqs: list[Req] = []
        # Prompt tokens that the prefix cache held for this EXTEND batch's requests that run
        # for the first time (a later chunk's own earlier chunks do not count).
        self.cached_tokens = 0

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # ---- memory ---------------------------------------------------------------------------
    def _evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def _alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_loc: list[int]) -> torch.Tensor:
        page = self.allocator.page_size
        # Upper bound on slots: every request may need one extra partial page.
        need = sum(s - p for p, s in zip(prefix_lens, seq_lens)) + len(seq_lens) * page
        self._evict_for(need)
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc, sum(seq_lens) - sum(prefix_lens))
        if out is None:
            raise OutOfKVMemory(f"cannot allocate {need} KV slots for a prefill")
        return out

    # ---- EXTEND ---------------------------------------------------------------------------
    def prepare_for_extend(self, embed: bool = False) -> ForwardBatch:
        """Allocate request rows and KV slots for each request's extend segment."""
        self.forward_mode = ForwardMode.EMBED if embed else ForwardMode.EXTEND
        table = self.req_to_token_pool.req_to_token
        for req in self.reqs:
            if req.req_pool_idx is None:
                rows = self.req_to_token_pool.alloc(1)
                if rows is None:
                    raise OutOfKVMemory("no free request slot")
                req.req_pool_idx = rows[0]
        prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        seq_lens = [len(r.fill_ids) for r in self.reqs]
        last_loc = [int(table[r.req_pool_idx, p - 1]) if p > 0 else -1 for r, p in zip(self.reqs, prefix_lens)]
        out_cache_loc = self._alloc_extend(prefix_lens, seq_lens, last_loc)

        input_ids: list[int] = []
        positions: list[int] = []
        start = 0
        for req, pre, seq in zip(self.reqs, prefix_lens, seq_lens):
            n = seq - pre
            if pre:
                table[req.req_pool_idx, :pre] = req.prefix_indices
            table[req.req_pool_idx, pre:seq] = out_cache_loc[start : start + n]
            input_ids.extend(req.fill_ids[pre:seq])
            positions.extend(range(pre, seq))
            start += n

        self.sampling_reqs = [r for r in self.reqs if not r.is_chunked]
        self.sampling_info = SamplingBatchInfo.from_reqs(self.sampling_reqs, self.vocab_size, self.device)
        logprob_starts = [self._input_logprob_start(r, p, s) for r, p, s in zip(self.reqs, prefix_lens, seq_lens)]
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64, device=self.device),
            out_cache_loc=out_cache_loc.to(self.device),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=[s - p for p, s in zip(prefix_lens, seq_lens)],
            req_to_token_pool=self.req_to_token_pool,
            return_logprob=any(n < s - p for n, p, s in zip(logprob_starts, prefix_lens, seq_lens)),
            extend_logprob_start_lens_cpu=logprob_starts,
        )

    @staticmethod
    def _input_logprob_start(req: Req, pre: int, seq: int) -> int:
        """First row of this extend segment whose logits give an input logprob, or the
        segment length when none does. Row j (absolute position pre+j) predicts token pre+j+1;
        input logprobs cover prompt tokens logprob_start_len .. len(prompt)-1."""
        n = seq - pre
        if not req.return_logprob or req.input_logprobs_done:
            return n
        first = max(req.logprob_start_len - 1, 0) - pre
        return max(first, 0) if first < n else n

    # ---- DECODE ---------------------------------------------------------------------------
    def new_decode_tokens_needed(self) -> int:
        """KV slots the next decode step must find: a fresh page for each request whose new
        token (position seqlen-1) starts a page."""
        page = self.allocator.page_size
        return sum(page for r in self.reqs if (r.seqlen - 1) % page == 0)

    def check_decode_mem(self) -> bool:
        need = self.new_decode_tokens_needed()
        self._evict_for(need)
        return self.allocator.available_size() >= need

    def prepare_for_decode(self) -> ForwardBatch:
        self.forward_mode = ForwardMode.DECODE
        table = self.req_to_token_pool.req_to_token
        seq_lens = [r.seqlen for r in self.reqs]
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        last_loc = table[rows, lens - 2]  # slot of position seqlen-2, the last cached token
        out = self.allocator.alloc_decode(seq_lens, last_loc.tolist())
        if out is None:
            raise OutOfKVMemory("decode step found no KV slots (check_decode_mem must run first)")
        table[rows, lens - 1] = out
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(self.reqs),
            input_ids=torch.tensor([r.output_ids[-1] for r in self.reqs], dtype=torch.int64, device=self.device),
            positions=(lens - 1).to(self.device),
            seq_lens=lens.to(self.device),
            req_pool_indices=rows.to(self.device),
            out_cache_loc=out.to(self.device),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=[s - 1 for s in seq_lens],
            extend_seq_lens_cpu=[1] * len(seq_lens),
            req_to_token_pool=self.req_to_token_pool,
        )

    # ---- MIXED (prefill + decode in one forward) -------------------------------------------
    def mix_with_running(self, extend_fb: ForwardBatch, running: ScheduleBatch) -> ForwardBatch:
        """Fold the running batch's next decode step into this prefill batch (SGLang's mixed
        chunk): each running request becomes an extend segment of one token (its newest
        output, at position seqlen-1, over its seqlen-1 cached tokens), after this batch's
        segments. The caller checked `running.check_decode_mem()`.

        Afterwards this batch holds [prefill reqs..., running reqs...]; it samples for its
        non-chunked prefill reqs and then every running req (the logits rows in that order),
        and `running` is left empty (the requests come back when this batch is merged)."""
        dec = running.prepare_for_decode()
        assert self.sampling_info is not None and running.sampling_info is not None
        assert extend_fb.out_cache_loc is not None and dec.out_cache_loc is not None
        n = len(running.reqs)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=extend_fb.batch_size + n,
            input_ids=torch.cat([extend_fb.input_ids, dec.input_ids]),
            positions=torch.cat([extend_fb.positions, dec.positions]),
            seq_lens=torch.cat([extend_fb.seq_lens, dec.seq_lens]),
            req_pool_indices=torch.cat([extend_fb.req_pool_indices, dec.req_pool_indices]),
            out_cache_loc=torch.cat([extend_fb.out_cache_loc, dec.out_cache_loc]),
            seq_lens_cpu=extend_fb.seq_lens_cpu + dec.seq_lens_cpu,
            extend_prefix_lens_cpu=extend_fb.extend_prefix_lens_cpu + dec.extend_prefix_lens_cpu,
            extend_seq_lens_cpu=extend_fb.extend_seq_lens_cpu + [1] * n,
            req_to_token_pool=self.req_to_token_pool,
            return_logprob=extend_fb.return_logprob,
            # A decoding request's input logprobs are done: its one row predicts no input token.
            extend_logprob_start_lens_cpu=extend_fb.extend_logprob_start_lens_cpu + [1] * n,
        )
        self.sampling_info.merge_batch(running.sampling_info)
        self.decoding_reqs = list(running.reqs)
        self.reqs = self.reqs + running.reqs
        self.sampling_reqs = self.sampling_reqs + running.reqs
        running.reqs, running.sampling_info = [], None
        return fb

    # ---- composition ----------------------------------------------------------------------
    def filter_batch(self, keep: list[int]) -> None:
        """Keep only self.reqs[i] for i in keep (in order); sampling rows follow."""
        if len(keep) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep]
        if self.sampling_info is not None:
            self.sampling_info.filter_batch(keep)

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Append the sampling requests of a finished prefill batch to this running batch."""
        if not other.sampling_reqs:
            return
        assert other.sampling_info is not None
        if self.sampling_info is None or not self.reqs:
            self.sampling_info = other.sampling_info
        else:
            self.sampling_info.merge_batch(other.sampling_info)
        self.reqs = self.reqs + other.sampling_reqs
