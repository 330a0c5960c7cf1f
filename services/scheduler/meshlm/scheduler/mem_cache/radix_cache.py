"""RadixCache: a radix tree of token sequences whose nodes own the KV slots of those tokens.

Tree invariants:
  * Each non-root node has a non-empty `key` (token ids) and a `value` (int64 KV slots) of the
    same length; the sequence of a node is the concatenation of keys from the root to it.
  * Children are keyed by their first token (page_size 1) or by the tuple of their first page
    (page_size > 1); siblings never share that child key. With page_size > 1 every key length
    is a multiple of page_size, so nodes only ever hold whole pages.
  * `lock_ref` of a node = number of live locks on it or on any descendant (a lock on a node
    counts on the whole path to the root). The root is permanently locked and holds no tokens.
  * evictable_size + protected_size == total tokens in the tree, where a node counts as
    protected iff lock_ref > 0. `_evictable_leaves` is exactly the set of non-root nodes with
    no children and lock_ref == 0.

Only the tree frees tree-owned slots, and only in `evict`. See base_prefix_cache.py for which
slots of a request the tree owns.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from meshlm.scheduler.mem_cache.memory_pool import ReqToTokenPool

ChildKey = int | tuple[int, ...]


class TreeNode:
    """One edge of the radix tree plus the node it leads to (see module invariants)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "hit_count")

    def __init__(
        self,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
        parent: TreeNode | None = None,
        access_time: int = 0,
    ) -> None:
        """access_time: the owning cache's access counter when the node was made (LRU order)."""
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = access_time
        self.hit_count = 0

    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:
        # Heap order for eviction: least recently used first.
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        head = self.key[:8]
        more = "..." if len(self.key) > 8 else ""
        return f"TreeNode(len={len(self.key)}, key={head}{more}, lock_ref={self.lock_ref})"


class RadixCache(BasePrefixCache):
    """SGLang-style prefix cache with LRU eviction of unlocked leaves.

    With `disable=True` nothing is ever cached: it behaves exactly like ChunkCache.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        disable: bool = False,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        self.disable = disable
        # Access counter of this tree's nodes: deterministic LRU order, no ties from a coarse clock.
        self._clock = itertools.count()
        self.reset()

    def _tick(self) -> int:
        return next(self._clock)

    def reset(self) -> None:
        """Forget the whole tree. Does not free slots: clear the allocator alongside."""
        self.root_node = TreeNode(access_time=self._tick())
        self.root_node.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_leaves: set[TreeNode] = set()

    # ---- key helpers -----------------------------------------------------------------------
    def _child_key(self, key: list[int]) -> ChildKey:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, counted in whole pages."""
        n = min(len(a), len(b))
        P = self.page_size
        i = 0
        if P == 1:
            while i < n and a[i] == b[i]:
                i += 1
            return i
        while i + P <= n and a[i : i + P] == b[i : i + P]:
            i += P
        return i

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Re-establish `node`'s membership in the evictable-leaf set."""
        if node is not self.root_node and not node.children and node.lock_ref == 0:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens (0 < n < len); return the new upper node.

        The upper node inherits lock_ref (every lock below it passes through it) and access
        data; `child` keeps the suffix and its children, so its leaf status is unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(key=child.key[:n], value=child.value[:n], parent=parent)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        parent.children[self._child_key(upper.key)] = upper  # same child key as before
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ---- match / insert --------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`, truncated to whole pages; splits a node if needed."""
        if self.disable:
            return MatchResult(self._empty_indices(), self.root_node)
        key = key[: len(key) // self.page_size * self.page_size]
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            child.hit_count += 1
            # n >= one page: the child key (first token / first page) matched.
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else self._empty_indices()
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert key→value; return how many leading tokens were already cached.

        Slots value[:returned] are NOT taken by the tree (it keeps its own); the caller frees
        any of them it owns. The rest of `value` is copied into a new leaf and owned by the tree.
        """
        if self.disable:
            return 0
        if len(key) != len(value):
            raise ValueError(f"insert: key has {len(key)} tokens but value has {len(value)}")
        if len(key) % self.page_size:
            raise ValueError(f"insert: key length {len(key)} is not page-aligned")
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        prefix_len = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            prefix_len += n
            key = key[n:]
            value = value[n:]
            if n < len(child.key):
                # Diverges inside child: the remainder hangs off the split point.
                node = self._split(child, n)
                break
            node = child
        if key:
            leaf = TreeNode(key=list(key), value=value.to(self.device).clone(), parent=node, access_time=self._tick())
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_size += len(leaf.key)
            self._refresh_leaf(node)
            self._refresh_leaf(leaf)
        return prefix_len

    # ---- request hooks -----------------------------------------------------------------------
    def _owned_start(self, req: Any) -> int:
        if self.disable:
            return 0
        # Tree-owned prefix = prefix_indices minus any unaligned request-owned tail.
        return len(req.prefix_indices) // self.page_size * self.page_size

    def _insert_req_kv(self, req: Any, token_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Insert the page-aligned part of the row's KV; free the request's duplicates.

        Returns (kv view of the row for token_ids, aligned length inserted).
        """
        row = req.req_pool_idx
        kv = self.req_to_token_pool.req_to_token[row, : len(token_ids)]
        aligned = len(token_ids) // self.page_size * self.page_size
        protected = self._owned_start(req)
        new_prefix_len = self.insert(token_ids[:aligned], kv[:aligned])
        # kv[:protected] are the tree's own slots (locked, so still cached); kv[protected:
        # new_prefix_len] are request slots for tokens the tree already had: duplicates.
        if new_prefix_len < protected:
            raise AssertionError("locked prefix of a request is missing from the tree")
        if new_prefix_len > protected:
            self.token_to_kv_pool_allocator.free(kv[protected:new_prefix_len])
        return kv, aligned

    def cache_finished_req(self, req: Any) -> None:
        """Insert a finished request's KV, free what the tree does not keep, release the row.

        KV exists for (origin_input_ids + output_ids)[:-1] (the newest token was never fed).
        """
        if req.req_pool_idx is None:
            return
        n_kv = len(req.origin_input_ids) + len(req.output_ids) - 1
        if self.disable:
            self.release_req(req, n_kv)
            return
        token_ids = (req.origin_input_ids + req.output_ids)[:n_kv]
        kv, aligned = self._insert_req_kv(req, token_ids)
        # The unaligned tail (part of a page) is not cached.
        if aligned < len(token_ids):
            self.token_to_kv_pool_allocator.free(kv[aligned:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Cache the KV of req.fill_ids (all computed) and keep the request running.

        Afterwards req.prefix_indices = tree slots of the aligned part + the request-owned
        unaligned tail, the row points at the tree's slots, and the lock moves to the new last
        node. `chunked` is accepted for interface parity and does not change behaviour.
        """
        row = req.req_pool_idx
        if row is None:
            raise ValueError("cache_unfinished_req: request has no req_to_token row")
        token_ids = req.fill_ids
        if self.disable:
            req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
            return
        protected = self._owned_start(req)
        kv, aligned = self._insert_req_kv(req, token_ids)
        new_indices, new_last_node = self.match_prefix(token_ids)
        assert len(new_indices) == aligned, "just-inserted prefix must match in full"
        # Point the row at the tree's slots where the request's duplicates were freed.
        self.req_to_token_pool.req_to_token[row, protected:aligned] = new_indices[protected:]
        self.inc_lock_ref(new_last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([new_indices, kv[aligned:].clone()])
        req.last_node = new_last_node

    # ---- locking / eviction -----------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock node and its ancestors; return the change in evictable size (<= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.parent is None:
                raise ValueError(f"inc_lock_ref on a node no longer in the tree: {node}")
            if node.lock_ref == 0:
                # 0 -> 1: the node's tokens stop being evictable.
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one inc_lock_ref(node); return the change in evictable size (>= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref <= 0 or node.parent is None:
                raise ValueError(f"dec_lock_ref on an unlocked or detached node: {node}")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._refresh_leaf(node)
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free LRU unlocked leaves until num_tokens are freed or none is left; return freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = list(self._evictable_leaves)
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node in self._evictable_leaves
            freed.append(node.value)
            num_evicted += len(node.key)
            del parent.children[self._child_key(node.key)]
            node.parent = None
            self._evictable_size -= len(node.key)
            self._evictable_leaves.discard(node)
            self._refresh_leaf(parent)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, parent)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_evicted

    # ---- sizes / debugging ------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def _nodes(self) -> list[TreeNode]:
        """All non-root nodes, depth first."""
        out: list[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_values_flatten(self) -> torch.Tensor:
        """Every slot owned by the tree (for leak checks)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty_indices()

    def format_tree(self) -> str:
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            label = "root" if node is self.root_node else repr(node)
            lines.append("  " * depth + label)
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)

    def pretty_print(self) -> None:
        print(self.format_tree())
        print(f"total={self.total_size()} evictable={self._evictable_size} protected={self._protected_size}")

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, disable={self.disable}, "
            f"total={self.total_size()}, evictable={self._evictable_size}, "
            f"protected={self._protected_size}, nodes={len(self._nodes())})"
        )
