"""Which waiting requests to prefill next: SchedulePolicy (order) and PrefillAdder (budgets).

PrefillAdder budgets (SGLang's):
    rem_total_tokens  = free KV + evictable KV
                        - sum over running requests of min(max_new - out, CLIP) * new_token_ratio
                        - what this round already admitted (extend + min(max_new, CLIP))
    rem_input_tokens  = --max-prefill-tokens, minus this round's extend tokens
    rem_chunk_tokens  = --chunked-prefill-size, minus this round's extend tokens (None: no chunking)
(with --enable-mixed-chunk both also minus the running requests' decode tokens riding along)
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from meshlm.scheduler.managers.req import Req

if TYPE_CHECKING:
    from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
    from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache

CLIP_MAX_NEW_TOKENS = 4096
LPM_FALLBACK_QUEUE_LEN = 128  # lpm degrades to fcfs on long queues, as in SGLang


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()  # room for more
    NO_TOKEN = enum.auto()  # KV budget exhausted: the batch is full
    OTHER = enum.auto()  # input or chunk budget exhausted


def remaining_new_tokens(req: Req) -> int:
    """Decode tokens the request may still need, clipped so huge max_new_tokens don't starve."""
    max_new = req.sampling_params.max_new_tokens or 0
    return min(max(max_new - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: BasePrefixCache, radix_enabled: bool) -> None:
        self.policy = policy if radix_enabled else "fcfs"
        self.tree_cache = tree_cache

    def calc_priority(self, waiting: list[Req]) -> None:
        """Reorder the waiting queue in place. Every request must already hold its prefix match."""
        if self.policy == "lpm" and len(waiting) <= LPM_FALLBACK_QUEUE_LEN:
            waiting.sort(key=lambda r: -len(r.prefix_indices))


class PrefillAdder:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        allocator: TokenToKVPoolAllocator,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        page_size: int,
        mixed_with_decode_tokens: int = 0,
    ) -> None:
        """mixed_with_decode_tokens: decode tokens that will ride in this batch (mixed chunk);
        they count against the input and chunk budgets."""
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.page_size = page_size
        self.rem_input_tokens = max_prefill_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = (
            None if chunked_prefill_size is None else chunked_prefill_size - mixed_with_decode_tokens
        )
        # Reserved for decode tokens of running requests and of requests admitted this round.
        self.total_offset = sum(int(remaining_new_tokens(r) * new_token_ratio) for r in running_reqs)
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> int:
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return free - self.total_offset

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _charge(self, extend: int, max_new: int) -> None:
        self.total_offset += self._ceil_page(extend) + max_new
        self.rem_input_tokens -= self._ceil_page(extend)
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= self._ceil_page(extend)

    def _budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def add_chunked_req(self, req: Req) -> None:
        """Continue the in-progress chunked request first; it may finish its prompt this round."""
        self._add(req, locked=True)

    def add_one_req(self, req: Req) -> AddReqResult:
        extend = req.extend_input_len
        if extend + remaining_new_tokens(req) > self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        # Without chunking the first request may exceed the input cap (it must run somehow).
        if self._ceil_page(extend) > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens < self.page_size:
            return AddReqResult.OTHER
        self.tree_cache.inc_lock_ref(req.last_node)
        self._add(req, locked=False)
        return self._budget_state()

    def _add(self, req: Req, locked: bool) -> None:
        """Admit req, truncating it to a page-aligned chunk when it exceeds the chunk budget.
        An embedding request is never chunked: its forward pools over the whole input at once."""
        pre = len(req.prefix_indices)
        extend = req.extend_input_len
        chunk = self.rem_chunk_tokens
        if chunk is None or extend <= chunk or req.is_embedding:
            req.is_chunked = 0
            self.can_run_list.append(req)
            self._charge(extend, remaining_new_tokens(req))
            return
        # Truncate to a page-aligned chunk; the rest is prefilled in later rounds.
        trunc = chunk // self.page_size * self.page_size
        req.extend_input_len = trunc
        req.fill_ids = req.fill_ids[: pre + trunc]
        req.is_chunked += 1
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self._charge(trunc, 0)
