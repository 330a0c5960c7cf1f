"""KV memory: request→token table, K/V buffers, slot allocator and prefix caches."""

from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from meshlm.scheduler.mem_cache.chunk_cache import ChunkCache
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.mem_cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
]
