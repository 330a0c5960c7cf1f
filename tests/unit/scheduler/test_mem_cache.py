"""Tests for the memory pools and the KV slot allocator (mem_cache/memory_pool.py, allocator.py)."""

from __future__ import annotations

import random

import pytest
import torch

from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


# ---- ReqToTokenPool ----------------------------------------------------------------------------
def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(4, 16)
    assert pool.req_to_token.shape == (5, 16) and pool.req_to_token.dtype == torch.int64
    rows = pool.alloc(3)
    assert rows is not None and sorted(rows) == [1, 2, 3]
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free(rows[0])
    pool.free([rows[1]])
    assert pool.available_size() == 3
    with pytest.raises(ValueError):
        pool.free(rows[0])  # double free
    with pytest.raises(ValueError):
        pool.free(0)  # dummy row
    again = pool.alloc(3)
    assert again is not None and 0 not in again and len(set(again)) == 3
    pool.clear()
    assert pool.available_size() == pool.size == 4


# ---- MHATokenToKVPool --------------------------------------------------------------------------
def test_kv_pool_shapes_and_sizes() -> None:
    pool = MHATokenToKVPool(64, 16, torch.float16, head_num=2, head_dim=8, layer_num=3)
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    assert pool.k_buffer[0].shape == (64 + 16, 2, 8)
    cell = MHATokenToKVPool.cell_size_bytes(2, 8, 3, torch.float16)
    assert cell == 2 * 2 * 8 * 3 * 2
    assert pool.mem_usage_bytes() == (64 + 16) * cell


def test_kv_pool_set_casts_dtype() -> None:
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, head_num=2, head_dim=4, layer_num=2)
    loc = torch.tensor([3, 5])
    k = torch.randn(2, 2, 4)
    v = torch.randn(2, 8)  # flattened heads are accepted too
    pool.set_kv_buffer(1, loc, k, v)
    kb, vb = pool.get_kv_buffer(1)
    assert kb.dtype == torch.bfloat16
    torch.testing.assert_close(kb[loc], k.to(torch.bfloat16))
    torch.testing.assert_close(vb[loc], v.view(2, 2, 4).to(torch.bfloat16))
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layer untouched


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
def test_kv_pool_fp8_roundtrip() -> None:
    pool = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, head_num=1, head_dim=4, layer_num=1)
    k = torch.tensor([[[0.5, 1.0, -2.0, 0.25]]])
    pool.set_kv_buffer(0, torch.tensor([2]), k, k)
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    assert pool.get_value_buffer(0)[2].float().tolist() == k[0].tolist()


# ---- TokenToKVPoolAllocator --------------------------------------------------------------------
def test_size_rounds_down_to_pages() -> None:
    alloc = TokenToKVPoolAllocator(16 * 5 + 7, 16)
    assert alloc.size == 80 and alloc.available_size() == 80
    slots = alloc.alloc(80)
    assert slots is not None
    assert slots.min().item() == 16 and slots.max().item() == 80 + 16 - 1  # page 0 reserved
    with pytest.raises(ValueError):
        alloc.alloc(8)  # not a page multiple


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_free_conservation(page_size: int) -> None:
    rng = random.Random(0)
    alloc = TokenToKVPoolAllocator(page_size * 64, page_size, debug=True)
    held: list[torch.Tensor] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            got = alloc.alloc(rng.randint(1, 10) * page_size)
            if got is not None:
                held.append(got)
        flat = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert flat.unique().numel() == flat.numel(), "slot handed out twice"
        assert alloc.available_size() + flat.numel() == alloc.size
        if flat.numel():
            assert flat.min().item() >= page_size and flat.max().item() < alloc.size + page_size
    for h in held:
        alloc.free(h)
    assert alloc.available_size() == alloc.size
    assert alloc.free_page_ids().tolist() == list(range(1, 65))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_extend_and_decode_page_layout(page_size: int) -> None:
    """Random batched extends/decodes; every position sits at offset pos % P of its own page."""
    rng = random.Random(page_size)
    P = page_size
    alloc = TokenToKVPoolAllocator(P * 600, P, debug=True)
    seqs: list[list[int]] = [[] for _ in range(6)]  # position -> slot, per request
    for step in range(60):
        batch = rng.sample(range(6), rng.randint(1, 6))
        if step % 3 == 2:
            seq_lens = [len(seqs[i]) + 1 for i in batch]
            last = [seqs[i][-1] if seqs[i] else -1 for i in batch]
            out = alloc.alloc_decode(seq_lens, last)
            assert out is not None and out.numel() == len(batch)
            for i, s in zip(batch, out.tolist()):
                seqs[i].append(s)
        else:
            prefix = [len(seqs[i]) for i in batch]
            ext = [rng.randint(0, 3 * P + 2) for _ in batch]
            seq_lens = [p + e for p, e in zip(prefix, ext)]
            last = [seqs[i][-1] if seqs[i] else -1 for i in batch]
            out = alloc.alloc_extend(prefix, seq_lens, last, sum(ext))
            assert out is not None and out.numel() == sum(ext)
            parts = out.split(ext)
            for i, part in zip(batch, parts):
                seqs[i].extend(part.tolist())
        owners: dict[int, tuple[int, int]] = {}
        for r, slots in enumerate(seqs):
            for pos, slot in enumerate(slots):
                assert slot % P == pos % P
                page = slot // P
                assert page >= 1
                # A page belongs to one request and one page-aligned block of its positions.
                assert owners.setdefault(page, (r, pos // P)) == (r, pos // P)
        n_slots = sum(len(s) for s in seqs)
        assert len({s for seq in seqs for s in seq}) == n_slots
        assert alloc.size - alloc.available_size() == len(owners) * P
    for slots in seqs:
        if slots:
            alloc.free(torch.tensor(slots))
    assert alloc.available_size() == alloc.size


def test_alloc_extend_continues_partial_page() -> None:
    alloc = TokenToKVPoolAllocator(16 * 8, 16, debug=True)
    first = alloc.alloc_extend([0], [5], [-1], 5)
    assert first is not None
    base = first[0].item()
    assert base % 16 == 0 and first.tolist() == list(range(base, base + 5))
    # Positions 5..20: 5..15 continue the page, 16..20 go to a fresh page at offsets 0..4.
    more = alloc.alloc_extend([5], [21], [base + 4], 16).tolist()
    assert more[:11] == list(range(base + 5, base + 16))
    fresh = more[11]
    assert fresh % 16 == 0 and fresh // 16 != base // 16
    assert more[11:] == list(range(fresh, fresh + 5))
    assert alloc.available_size() == alloc.size - 32


def test_alloc_decode_crosses_page_boundary() -> None:
    alloc = TokenToKVPoolAllocator(16 * 4, 16, debug=True)
    page = alloc.alloc(16)
    assert page is not None
    last = page[-1].item()
    # 16 positions filled; the 17th token (position 16) needs a fresh page.
    slot = alloc.alloc_decode([17], [last]).item()
    assert slot % 16 == 0 and slot // 16 != last // 16
    nxt = alloc.alloc_decode([18], [slot]).item()
    assert nxt == slot + 1
    # Mixed batch: one continues, one needs a page.
    out = alloc.alloc_decode([19, 17], [nxt, last]).tolist()
    assert out[0] == nxt + 1 and out[1] % 16 == 0 and out[1] // 16 not in (slot // 16, last // 16)
    assert alloc.available_size() == 16


def test_exhaustion_returns_none_without_leaking() -> None:
    alloc = TokenToKVPoolAllocator(4 * 4, 4, debug=True)  # 4 pages
    held = alloc.alloc(12)
    assert held is not None and alloc.available_size() == 4
    assert alloc.alloc(8) is None
    assert alloc.alloc_extend([0, 0], [3, 2], [-1, -1], 5) is None  # needs 2 pages
    assert alloc.alloc_decode([5, 9], [held[3].item(), held[7].item()]) is None  # needs 2
    assert alloc.available_size() == 4
    # Continuing a partial page needs no new page, even with none free.
    last_page = alloc.alloc(4)
    assert last_page is not None and alloc.available_size() == 0
    cont = alloc.alloc_extend([1], [3], [held[0].item()], 2)
    assert cont is not None and cont.tolist() == [held[1].item(), held[2].item()]
    assert alloc.alloc_decode([2], [held[4].item()]).tolist() == [held[5].item()]
    assert alloc.alloc_decode([5], [held[3].item()]) is None
    alloc.free(torch.cat([held, last_page]))
    assert alloc.available_size() == 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_group_batches_and_dedups(page_size: int) -> None:
    alloc = TokenToKVPoolAllocator(page_size * 8, page_size, debug=True)
    a = alloc.alloc(2 * page_size)
    b = alloc.alloc(page_size)
    assert a is not None and b is not None
    alloc.free_group_begin()
    alloc.free(a[:1])
    alloc.free(a)  # overlaps the previous call: the page is still freed once
    alloc.free(b)
    assert alloc.available_size() == 5 * page_size  # nothing freed yet
    alloc.free_group_end()
    assert alloc.available_size() == 8 * page_size


def test_double_free_and_padding_page() -> None:
    alloc = TokenToKVPoolAllocator(16, 4, debug=True)
    slots = alloc.alloc(4)
    assert slots is not None
    alloc.free(slots)
    with pytest.raises(AssertionError):
        alloc.free(slots[:1])
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([0]))
    lax = TokenToKVPoolAllocator(16, 4)
    lax.free(torch.tensor([0, 1, 2]))  # padding page: dropped, never handed out
    assert lax.available_size() == 16
    got = lax.alloc(16)
    assert got is not None and got.min().item() >= 4
