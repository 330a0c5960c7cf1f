"""SchedulerMemory: the KV memory one scheduler schedules over, and the prefix cache on it.

The ModelRunner builds the pools (request rows, K/V buffers, slot allocator); the scheduler
adds the prefix cache (RadixCache, or ChunkCache with --disable-radix-cache). Every part of the
scheduler that allocates, caches or frees KV is given this one object.

Invariant while no request is live (checked by `check_idle`): every KV slot is free or cached
(allocator.available_size() + tree_cache.evictable_size() == max_total_num_tokens), nothing in
the tree is locked, and every request row is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache
from meshlm.scheduler.mem_cache.chunk_cache import ChunkCache
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.mem_cache.radix_cache import RadixCache
from meshlm.scheduler.model_executor.model_runner import ModelRunner


@dataclass(frozen=True)
class SchedulerMemory:
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    kv_pool: MHATokenToKVPool
    tree_cache: BasePrefixCache
    max_total_num_tokens: int  # KV slots in the pool
    max_running_requests: int  # request rows: requests holding KV at once
    vocab_size: int
    device: torch.device

    @classmethod
    def from_runner(cls, runner: ModelRunner, config: SchedulerConfig, vocab_size: int) -> SchedulerMemory:
        """The runner's pools, with the prefix cache the config asks for."""
        cache_cls = ChunkCache if config.disable_radix_cache else RadixCache
        tree_cache = cache_cls(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, config.page_size)
        return cls(
            req_to_token_pool=runner.req_to_token_pool,
            allocator=runner.token_to_kv_pool_allocator,
            kv_pool=runner.token_to_kv_pool,
            tree_cache=tree_cache,
            max_total_num_tokens=runner.max_total_num_tokens,
            max_running_requests=runner.max_running_requests,
            vocab_size=vocab_size,
            device=runner.device,
        )

    def new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(
            reqs, self.req_to_token_pool, self.allocator, self.tree_cache, self.vocab_size, self.device
        )

    def reusable_tokens(self) -> int:
        """KV slots a new allocation may get: free ones plus cached ones it may evict."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def num_used_tokens(self) -> int:
        """KV slots held by requests (not free and not merely cached for reuse)."""
        return self.max_total_num_tokens - self.reusable_tokens()

    def flush(self) -> None:
        """Forget every cached prefix and free every slot and row; only while no request is live."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    def check_idle(self) -> None:
        """Raise RuntimeError naming the leak when the module's idle invariant does not hold."""
        if self.reusable_tokens() != self.max_total_num_tokens or self.tree_cache.protected_size() != 0:
            raise RuntimeError(
                f"KV leak: free {self.allocator.available_size()} + evictable "
                f"{self.tree_cache.evictable_size()} != {self.max_total_num_tokens}, "
                f"protected {self.tree_cache.protected_size()}"
            )
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            raise RuntimeError("request slot leak: rows still held while idle")
