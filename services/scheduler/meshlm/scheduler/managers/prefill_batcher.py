"""PrefillBatcher: the next prefill batch from the waiting queue (SGLang's
Scheduler.get_new_batch_prefill).

Each round: match every waiting request's prefix in the cache, order the queue
(SchedulePolicy), continue the chunked request first, then admit waiting requests while the
PrefillAdder's budgets and max_running_requests allow. One kind of forward per batch
(generation or embedding). With --enable-mixed-chunk the running requests' decode step rides
in the batch (ScheduleBatch.mix_with_running) and their tokens count against its budgets.

In-batch prefix sharing: a request whose first IN_BATCH_PREFIX_TOKENS tokens equal those of a
request picked this round waits one round, then finds that prefix in the radix cache instead
of computing it again. Decisions depend only on token ids and queue order (never on the value
of an object id), so every TP rank builds the same batch.
"""

from __future__ import annotations

import time

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_state import SchedulerState
from meshlm.scheduler.managers.scheduler_stats import SchedulerStats

IN_BATCH_PREFIX_TOKENS = 32  # SGLang's IN_BATCH_PREFIX_CACHING thresholds
MIN_STALL_BOUNDED_CHUNK = 256  # below this a chunk's forward is mostly fixed per-forward cost

PrefixHead = tuple[int, ...]


class PrefillBatcher:
    def __init__(
        self, config: SchedulerConfig, memory: SchedulerMemory, state: SchedulerState, stats: SchedulerStats
    ) -> None:
        self.memory = memory
        self.state = state
        self.stats = stats
        self.radix = not config.disable_radix_cache
        self.policy = SchedulePolicy(config.schedule_policy, memory.tree_cache, self.radix)
        self.max_prefill_tokens = config.max_prefill_tokens
        self.chunked_prefill_size = None if config.chunked_prefill_size == -1 else config.chunked_prefill_size
        self.chunk_per_req = config.prefill_chunk_per_req
        self.page_size = config.page_size
        self.enable_mixed_chunk = config.enable_mixed_chunk

    def match_prefix(self, req: Req) -> None:
        """Find the cached prefix of req's fill_ids (at least one token is always computed;
        with input logprobs wanted, no further than logprob_start_len)."""
        req.fill_ids = req.origin_input_ids + req.output_ids
        limit = len(req.fill_ids) - 1
        if req.return_logprob and not req.input_logprobs_done:
            # Row logprob_start_len-1 predicts the first wanted token: it must be computed.
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        if req.is_embedding:
            limit = 0
        match = self.memory.tree_cache.match_prefix(req.fill_ids[:limit])
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        req.cache_protected_len = len(req.prefix_indices)
        req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """The next prefill batch with its forward prepared (batch.pending_fb), or None."""
        state, max_running = self.state, self.memory.max_running_requests
        if not state.waiting_queue and state.chunked_req is None:
            return None
        running_bs = len(state.running_batch.reqs)
        if running_bs >= max_running and state.chunked_req is None:
            return None
        for req in state.waiting_queue:
            self.match_prefix(req)
        self.policy.calc_priority(state.waiting_queue)
        mixing = self.enable_mixed_chunk and not state.running_batch.is_empty()
        adder = PrefillAdder(
            self.memory.tree_cache,
            self.memory.allocator,
            state.running_batch.reqs,
            state.new_token_ratio,
            self.max_prefill_tokens,
            self.chunk_budget(running_bs, len(state.waiting_queue)),
            self.page_size,
            mixed_with_decode_tokens=running_bs if mixing else 0,
        )
        picked_heads: set[PrefixHead] = set()
        embed: bool | None = None
        if state.chunked_req is not None:
            state.chunked_req.init_next_round_input()
            adder.add_chunked_req(state.chunked_req)
            embed = state.chunked_req.is_embedding
            picked_heads.add(self._head(state.chunked_req))
        for req in state.waiting_queue:
            if running_bs + len(adder.can_run_list) >= max_running:
                break
            if embed is not None and req.is_embedding != embed:
                break  # one kind of forward per batch
            head = self._head(req)
            short_match = req.cache_protected_len < IN_BATCH_PREFIX_TOKENS
            if self.radix and adder.can_run_list and short_match and head in picked_heads:
                continue
            res = adder.add_one_req(req)
            if adder.can_run_list and adder.can_run_list[-1] is req:
                embed = req.is_embedding
                picked_heads.add(head)
            if res is not AddReqResult.CONTINUE or adder.new_chunked_req is not None:
                break
        if not adder.can_run_list:
            return None
        return self._build(adder, bool(embed), mixing)

    def _build(self, adder: PrefillAdder, embed: bool, mixing: bool) -> ScheduleBatch:
        """Take the adder's requests out of the waiting queue into a prepared batch."""
        state = self.state
        picked = {id(r) for r in adder.can_run_list}
        state.waiting_queue = [r for r in state.waiting_queue if id(r) not in picked]
        state.chunked_req = adder.new_chunked_req
        cached = 0
        for req in adder.can_run_list:
            # A request's first round (not a later chunk, not a retracted request's re-prefill
            # nor a migrated one's: those hold outputs) is where its prompt and hits count.
            first_round = not req.times.scheduled and not req.output_ids
            if not req.times.scheduled:
                req.times.scheduled = time.time()
            if first_round:
                req.cached_tokens = req.cache_protected_len
                cached += req.cache_protected_len
                self.stats.record_prefill(len(req.origin_input_ids), req.cache_protected_len)
        batch = self.memory.new_batch(adder.can_run_list)
        batch.cached_tokens = cached
        batch.pending_fb = batch.prepare_for_extend(embed=embed)
        if mixing and not embed:
            running = state.running_batch
            running.filter_batch([i for i, r in enumerate(running.reqs) if not r.finished()])
            if not running.is_empty() and running.check_decode_mem():
                batch.pending_fb = batch.mix_with_running(batch.pending_fb, running)
        return batch

    def chunk_budget(self, running_bs: int, waiting: int) -> int | None:
        """The chunk budget of a prefill batch while running_bs requests decode and `waiting` wait
        (None: no chunking).

        A prefill forward stalls the running requests (mixed, each gets one token from it) and
        serves the waiting ones, so the chunk is prefill_chunk_per_req tokens per request
        in the system: a few arrivals beside a decoding batch come in small chunks (the running
        requests keep their pace), a burst of arrivals in large ones (its TTFT). With nothing
        running the whole --chunked-prefill-size is used.
        """
        full = self.chunked_prefill_size
        if full is None or running_bs == 0 or self.chunk_per_req == 0:
            return full
        floor = min(full, max(MIN_STALL_BOUNDED_CHUNK, self.page_size))
        return max(floor, min(full, self.chunk_per_req * (running_bs + waiting)))

    @staticmethod
    def _head(req: Req) -> PrefixHead:
        """The first tokens of a request: equal heads mean a shared prefix worth reusing.

        A short request's head holds id(req) only to be unique among live requests: it equals
        no other head, so decisions never depend on the id's value (same on every TP rank)."""
        if len(req.fill_ids) <= IN_BATCH_PREFIX_TOKENS:
            return (-1, id(req))  # too short to share: unique
        return tuple(req.fill_ids[:IN_BATCH_PREFIX_TOKENS])
