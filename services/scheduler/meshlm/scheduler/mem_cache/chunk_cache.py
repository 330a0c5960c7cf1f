"""ChunkCache: the prefix cache used with --disable-radix-cache (no reuse across requests).

Every KV slot a request uses is owned by that request (owned_start == 0): nothing is ever
matched, inserted or evicted. The class exists so chunked prefill works unchanged: after each
chunk the computed KV simply stays in the request's row as its prefix.
"""

from __future__ import annotations

from typing import Any

from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from meshlm.scheduler.mem_cache.memory_pool import ReqToTokenPool
from meshlm.scheduler.mem_cache.radix_cache import TreeNode


class ChunkCache(BasePrefixCache):
    """No-reuse cache; same interface as RadixCache. evictable/protected/total sizes are 0."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        # A permanently empty root, returned as last node so callers may lock it harmlessly.
        self.root_node = TreeNode()
        self.root_node.lock_ref = 1

    def reset(self) -> None:
        """Nothing is cached, so there is nothing to forget."""

    def _owned_start(self, req: Any) -> int:
        return 0

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(self._empty_indices(), self.root_node)

    def cache_finished_req(self, req: Any) -> None:
        """Free all of the request's KV ((input + output)[:-1] positions) and its row."""
        self.release_req(req, len(req.origin_input_ids) + len(req.output_ids) - 1)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Keep the KV of req.fill_ids as the request's own prefix for the next chunk."""
        row = req.req_pool_idx
        if row is None:
            raise ValueError("cache_unfinished_req: request has no req_to_token row")
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(req.fill_ids)].clone()

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"ChunkCache(page_size={self.page_size})"
