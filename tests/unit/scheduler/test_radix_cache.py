"""Tests for RadixCache and ChunkCache (mem_cache/radix_cache.py, chunk_cache.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from meshlm.scheduler.mem_cache import (
    BasePrefixCache,
    ChunkCache,
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    TreeNode,
)


@dataclass
class FakeReq:
    """The attributes of Req the caches touch, plus test bookkeeping (kv_len, target)."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    kv_len: int = 0  # positions of the row holding slots
    target_out: int = 1


def make(page_size: int, size: int = 256, kind: str = "radix"):
    req_pool = ReqToTokenPool(16, 512)
    alloc = TokenToKVPoolAllocator(size, page_size, debug=True)
    cache: BasePrefixCache
    if kind == "chunk":
        cache = ChunkCache(req_pool, alloc, page_size)
    else:
        cache = RadixCache(req_pool, alloc, page_size, disable=(kind == "disabled"))
    return req_pool, alloc, cache


def insert_new(cache: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> int:
    """Insert key with fresh slots, freeing the duplicates like a caller must."""
    value = alloc.alloc(len(key))
    assert value is not None
    present = cache.insert(key, value)
    if present:
        alloc.free(value[:present])
    return present


# ---- basic tree operations --------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 4])
def test_insert_and_match(P: int) -> None:
    _, alloc, cache = make(P)
    key = list(range(100, 112))
    assert insert_new(cache, alloc, key) == 0
    assert cache.total_size() == 12 == cache.evictable_size()
    m = cache.match_prefix(key + [7])
    assert len(m.device_indices) == 12
    partial = cache.match_prefix(key[:6] + [999, 998])
    assert len(partial.device_indices) == (6 if P == 1 else 4)  # whole pages only
    assert cache.match_prefix(key[: P - 1] if P > 1 else []).device_indices.numel() == 0
    assert cache.match_prefix([5, 6, 7, 8]).device_indices.numel() == 0
    # The matched slots are the inserted ones.
    again = cache.match_prefix(key)
    assert sorted(again.device_indices.tolist()) == sorted(cache.all_values_flatten().tolist())


@pytest.mark.parametrize("P", [1, 4])
def test_match_splits_node(P: int) -> None:
    _, alloc, cache = make(P)
    key = list(range(12))
    insert_new(cache, alloc, key)
    m = cache.match_prefix(key[:8] + [50] * 4)
    assert len(m.device_indices) == 8
    (top,) = cache.root_node.children.values()
    assert top is m.last_device_node and len(top.key) == 8
    (bottom,) = top.children.values()
    assert bottom.key == key[8:] and bottom.parent is top
    assert cache.total_size() == 12 and cache.evictable_size() == 12
    assert torch.equal(torch.cat([top.value, bottom.value]), cache.match_prefix(key).device_indices)


@pytest.mark.parametrize("P", [1, 4])
def test_insert_returns_present_prefix(P: int) -> None:
    _, alloc, cache = make(P)
    a = list(range(12))
    assert insert_new(cache, alloc, a) == 0
    assert insert_new(cache, alloc, a[:8] + [90, 91, 92, 93]) == 8
    assert insert_new(cache, alloc, a) == 12
    assert insert_new(cache, alloc, [70, 71, 72, 73]) == 0
    assert cache.total_size() == 12 + 4 + 4
    # Inside-page divergence: only whole pages count as present.
    b = a[:6] + [80, 81] + [82, 83, 84, 85]
    assert insert_new(cache, alloc, b) == (6 if P == 1 else 4)
    flat = cache.all_values_flatten()
    assert flat.unique().numel() == flat.numel() == cache.total_size()
    assert alloc.available_size() + cache.total_size() == alloc.size
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([4, 5]))


def test_page_keys_are_page_tuples() -> None:
    _, alloc, cache = make(4)
    insert_new(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    insert_new(cache, alloc, [1, 2, 3, 4, 5, 6, 9, 9])
    (top,) = cache.root_node.children.values()
    assert top.key == [1, 2, 3, 4]
    assert set(top.children) == {(5, 6, 7, 8), (5, 6, 9, 9)}
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([4, 5, 6]))  # not page-aligned


@pytest.mark.parametrize("P", [1, 4])
def test_lock_protects_from_eviction(P: int) -> None:
    _, alloc, cache = make(P)
    a, b = list(range(8)), list(range(100, 108))
    insert_new(cache, alloc, a)
    insert_new(cache, alloc, b)
    node = cache.match_prefix(a).last_device_node
    assert cache.inc_lock_ref(node) == -8
    assert cache.protected_size() == 8 and cache.evictable_size() == 8
    assert cache.evict(1000) == 8
    assert len(cache.match_prefix(a).device_indices) == 8
    assert cache.match_prefix(b).device_indices.numel() == 0
    assert cache.dec_lock_ref(node) == 8
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    assert cache.evict(1) == 8  # a whole leaf goes
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)  # evicted node


@pytest.mark.parametrize("P", [1, 4])
def test_lock_survives_split(P: int) -> None:
    _, alloc, cache = make(P)
    a = list(range(12))
    insert_new(cache, alloc, a)
    node = cache.match_prefix(a).last_device_node
    cache.inc_lock_ref(node)
    insert_new(cache, alloc, a[:4] + [60, 61, 62, 63])  # splits the locked node
    assert cache.protected_size() == 12 and cache.evictable_size() == 4
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 16


@pytest.mark.parametrize("P", [1, 4])
def test_evict_lru_order_and_parent_joins(P: int) -> None:
    _, alloc, cache = make(P)
    a, b, c = [1] * 4 + [2] * 4, [3] * 8, [4] * 8
    for k in (a, b, c):
        insert_new(cache, alloc, k)
    cache.match_prefix(a)  # touch a: b is now least recently used
    assert cache.evict(1) == 8
    assert cache.match_prefix(b).device_indices.numel() == 0
    assert len(cache.match_prefix(c).device_indices) == 8  # touch c: a is next
    assert cache.evict(8) == 8
    assert cache.match_prefix(a).device_indices.numel() == 0
    # A parent whose children are all evicted becomes a leaf and is evicted in the same call.
    d = [5] * 4
    insert_new(cache, alloc, d + [6] * 4)
    insert_new(cache, alloc, d + [7] * 4)
    evictable = cache.evictable_size()
    assert evictable == 8 + 12
    assert cache.evict(10_000) == evictable
    assert cache.total_size() == 0 and not cache.root_node.children
    assert alloc.available_size() == alloc.size


def test_reset_and_repr() -> None:
    _, alloc, cache = make(1)
    insert_new(cache, alloc, [1, 2, 3])
    assert "total=3" in repr(cache) and "root" in cache.format_tree()
    cache.reset()
    assert cache.total_size() == 0 and cache.all_values_flatten().numel() == 0


# ---- request hooks ------------------------------------------------------------------------------
def start(req_pool: ReqToTokenPool, cache: BasePrefixCache, req: FakeReq) -> None:
    """Scheduler admission: match (leaving >=1 token to compute), lock, take a row."""
    req.fill_ids = req.origin_input_ids + req.output_ids
    m = cache.match_prefix(req.fill_ids[:-1])
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    cache.inc_lock_ref(req.last_node)
    rows = req_pool.alloc(1)
    assert rows is not None
    req.req_pool_idx = rows[0]
    req.kv_len = len(req.prefix_indices)
    req_pool.req_to_token[req.req_pool_idx, : req.kv_len] = req.prefix_indices


def extend(req_pool, alloc, cache, req: FakeReq, end: int) -> bool:
    """Allocate and record slots for positions kv_len..end-1 (evicting if needed)."""
    row = req_pool.req_to_token[req.req_pool_idx]
    pre = req.kv_len
    last = int(row[pre - 1]) if pre else -1
    out = alloc.alloc_extend([pre], [end], [last], end - pre)
    if out is None:
        cache.evict(end - pre + alloc.page_size)
        out = alloc.alloc_extend([pre], [end], [last], end - pre)
    if out is None:
        return False
    row[pre:end] = out
    req.kv_len = end
    return True


@pytest.mark.parametrize("P", [1, 4])
def test_chunked_then_finished_flow(P: int) -> None:
    req_pool, alloc, cache = make(P)
    assert isinstance(cache, RadixCache)
    req = FakeReq(origin_input_ids=list(range(10)))
    start(req_pool, cache, req)
    assert extend(req_pool, alloc, cache, req, 6)
    req.fill_ids = req.origin_input_ids[:6]
    cache.cache_unfinished_req(req, chunked=True)
    aligned = 6 // P * P
    assert len(req.prefix_indices) == 6 and cache.total_size() == aligned
    assert cache.protected_size() == aligned
    assert torch.equal(req.prefix_indices, req_pool.req_to_token[req.req_pool_idx, :6])
    assert extend(req_pool, alloc, cache, req, 10)
    req.output_ids = [77, 78]  # one decoded token fed (position 10), one pending
    assert extend(req_pool, alloc, cache, req, 11)
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None and req_pool.available_size() == req_pool.size
    assert cache.total_size() == 11 // P * P and cache.protected_size() == 0
    assert alloc.available_size() + cache.total_size() == alloc.size
    # A second request with the same prompt reuses the cached pages.
    other = FakeReq(origin_input_ids=list(range(10)) + [77, 5])
    start(req_pool, cache, other)
    assert len(other.prefix_indices) == 11 // P * P


def check_invariants(req_pool, alloc, cache, active: list[FakeReq]) -> None:
    """Every page is exactly one of: free, tree-owned, owned by one active request."""
    P = alloc.page_size
    owners: list[int] = alloc.free_page_ids().tolist()
    is_radix = isinstance(cache, RadixCache) and not cache.disable
    if is_radix:
        tree = cache.all_values_flatten()
        assert tree.unique().numel() == tree.numel() == cache.total_size()
        tree_pages = (tree // P).unique()
        assert tree_pages.numel() * P == tree.numel()  # whole pages only
        owners += tree_pages.tolist()
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    else:
        assert cache.total_size() == cache.evictable_size() == 0
    for req in active:
        row = req_pool.req_to_token[req.req_pool_idx]
        start_pos = len(req.prefix_indices) // P * P if is_radix else 0
        owners += (row[start_pos : req.kv_len] // P).unique().tolist()
        if is_radix:
            # The tree-owned prefix is exactly the locked path from last_node to the root.
            path, node = [], req.last_node
            while node is not cache.root_node:
                assert node.lock_ref > 0 and node.parent is not None
                path.append(node.value)
                node = node.parent
            vals = torch.cat(path[::-1]) if path else torch.empty(0, dtype=torch.int64)
            assert torch.equal(vals, row[:start_pos])
    assert sorted(owners) == list(range(1, alloc.num_pages + 1)), "leaked or double-owned page"
    assert alloc.available_size() == alloc.free_page_ids().numel() * P


def simulate(kind: str, P: int, seed: int, ops: int = 250) -> None:
    rng = random.Random(seed)
    req_pool, alloc, cache = make(P, size=320, kind=kind)  # small: forces evictions
    bases = [[rng.randrange(50) for _ in range(30)] for _ in range(3)]
    active: list[FakeReq] = []
    done = 0

    def retire(req: FakeReq, finished: bool) -> None:
        if finished:
            cache.cache_finished_req(req)
        else:
            cache.release_req(req, req.kv_len)
        assert req.req_pool_idx is None
        active.remove(req)

    for _ in range(ops):
        op = rng.random()
        if op < 0.2 and len(active) < 6:
            base = rng.choice(bases)
            suffix = [rng.randrange(50) for _ in range(rng.randint(0, 20))]
            prompt = base[: rng.randint(1, 30)] + suffix
            req = FakeReq(origin_input_ids=prompt, target_out=rng.randint(1, 12))
            start(req_pool, cache, req)
            active.append(req)
        elif op < 0.93 and active:
            req = rng.choice(active)
            seqlen = len(req.origin_input_ids) + len(req.output_ids)
            if not req.output_ids:  # prefill, in chunks of up to 13 tokens
                end = min(len(req.fill_ids), req.kv_len + rng.randint(1, 13))
                if not extend(req_pool, alloc, cache, req, end):
                    retire(req, finished=False)
                elif end < len(req.fill_ids):
                    req.fill_ids = req.fill_ids[:end]
                    cache.cache_unfinished_req(req, chunked=True)
                    req.fill_ids = req.origin_input_ids + req.output_ids
                else:
                    req.output_ids.append(rng.randrange(50))
            else:  # decode: feed the newest token at position seqlen-1
                row = req_pool.req_to_token[req.req_pool_idx]
                slot = alloc.alloc_decode([seqlen], [int(row[seqlen - 2])])
                if slot is None:
                    cache.evict(P)
                    slot = alloc.alloc_decode([seqlen], [int(row[seqlen - 2])])
                if slot is None:
                    retire(req, finished=False)
                else:
                    row[seqlen - 1] = slot[0]
                    req.kv_len = seqlen
                    req.output_ids.append(rng.randrange(50))
            if req in active and len(req.output_ids) >= req.target_out:
                retire(req, finished=True)
                done += 1
        elif active and op < 0.95:  # retract / abort
            retire(rng.choice(active), finished=False)
        else:
            cache.evict(rng.randint(1, 40))
        check_invariants(req_pool, alloc, cache, active)

    for req in list(active):
        retire(req, finished=False)
    check_invariants(req_pool, alloc, cache, [])
    assert done > 5
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.total_size() == alloc.size
    cache.evict(10**9)
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    assert req_pool.available_size() == req_pool.size


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_requests_radix(P: int, seed: int) -> None:
    simulate("radix", P, seed)


@pytest.mark.parametrize("kind", ["chunk", "disabled"])
@pytest.mark.parametrize("P", [1, 4])
def test_random_requests_no_reuse(kind: str, P: int) -> None:
    simulate(kind, P, seed=7)


@pytest.mark.parametrize("kind", ["chunk", "disabled"])
def test_no_reuse_caches_never_match(kind: str) -> None:
    req_pool, alloc, cache = make(4, kind=kind)
    req = FakeReq(origin_input_ids=list(range(9)), output_ids=[1])
    start(req_pool, cache, req)
    assert extend(req_pool, alloc, cache, req, 9)
    cache.cache_unfinished_req(req)
    assert torch.equal(req.prefix_indices, req_pool.req_to_token[req.req_pool_idx, :10])
    cache.cache_finished_req(req)
    assert alloc.available_size() == alloc.size and cache.evictable_size() == 0
    m = cache.match_prefix(list(range(9)))
    assert m.device_indices.numel() == 0 and isinstance(m.last_device_node, TreeNode)
    assert cache.inc_lock_ref(m.last_device_node) == 0 and cache.evict(100) == 0


def test_real_req_is_compatible() -> None:
    req_mod = pytest.importorskip("meshlm.scheduler.managers.req")
    sp_mod = pytest.importorskip("meshlm.scheduler.sampling.sampling_params")
    try:
        req = req_mod.Req("r0", list(range(8)), sp_mod.SamplingParams())
    except TypeError:
        pytest.skip("SamplingParams needs arguments")
    req_pool, alloc, cache = make(4)
    req.init_next_round_input()
    start(req_pool, cache, req)  # type: ignore[arg-type]
    assert extend(req_pool, alloc, cache, req, 8)  # type: ignore[arg-type]
    req.output_ids = [3]
    cache.cache_finished_req(req)
    # KV of the 8 prompt tokens (the pending output token has none): two whole pages cached.
    assert cache.total_size() == 8 and alloc.available_size() == alloc.size - 8
    assert req.req_pool_idx is None
