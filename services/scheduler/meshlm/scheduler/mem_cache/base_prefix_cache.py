"""BasePrefixCache: the interface the scheduler uses for KV reuse, and what both caches share.

Ownership model. Every allocated KV page is owned by exactly one party:

  * the tree (RadixCache nodes), for page-aligned prefixes that were inserted; or
  * one request, for the slots it allocated that the tree does not own.

For a request in row r, positions [0, owned_start) of req_to_token[r] are tree slots (held
alive by the request's lock on `req.last_node`), and positions [owned_start, kv_len) are the
request's own slots. For RadixCache, owned_start = len(req.prefix_indices) floored to a page
(prefix_indices may carry an unaligned, request-owned tail after a chunk); for ChunkCache it
is 0. Releasing a request frees exactly its own slots, so every page is freed once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from meshlm.scheduler.mem_cache.radix_cache import TreeNode


class MatchResult(NamedTuple):
    """Longest cached prefix: its KV slots (int64, page-aligned length) and its deepest node."""

    device_indices: torch.Tensor
    last_device_node: TreeNode


class BasePrefixCache(ABC):
    """Common state and the request-release path; subclasses decide what is reused."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        if page_size != token_to_kv_pool_allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {token_to_kv_pool_allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.device

    def _empty_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    # ---- interface ---------------------------------------------------------------------------
    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult: ...

    @abstractmethod
    def cache_finished_req(self, req: Any) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def _owned_start(self, req: Any) -> int:
        """First position of req's row whose slot the request (not the tree) owns."""

    # ---- shared ------------------------------------------------------------------------------
    def release_req(self, req: Any, kv_len: int) -> None:
        """Drop a request without caching its KV (retraction, abort before prefill completes).

        `kv_len` = number of leading positions of the row that hold slots (tree-owned prefix
        plus the request's own allocations). Frees the request's own slots, releases its lock
        on `req.last_node`, frees its row and sets `req.req_pool_idx = None`. No-op without a row.
        """
        row = req.req_pool_idx
        if row is None:
            return
        start = self._owned_start(req)
        if kv_len > start:
            own = self.req_to_token_pool.req_to_token[row, start:kv_len]
            self.token_to_kv_pool_allocator.free(own)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
