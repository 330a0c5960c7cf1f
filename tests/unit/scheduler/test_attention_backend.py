"""The torch-native backend's decode over length buckets equals plain per-request attention over
each request's own cache positions, whatever the mix of lengths; buckets partition the batch."""

from __future__ import annotations

import random

import pytest
import torch

from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend, length_buckets
from meshlm.scheduler.layers.radix_attention import RadixAttention
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@pytest.mark.parametrize("lens", [[5, 3, 9], [700, 5, 300, 40, 1200, 90, 41, 650], [1] * 4 + [2000]])
def test_buckets_partition_rows_and_bound_padding(lens: list[int]) -> None:
    buckets = length_buckets(lens)
    assert sorted(i for b in buckets for i in b) == list(range(len(lens)))
    for b in buckets:
        lo, hi = min(lens[i] for i in b), max(lens[i] for i in b)
        assert hi <= max(lo * 1.25, lo + 64)


@pytest.mark.parametrize("lens", [[7, 130, 33, 900, 64, 480, 129], [50, 52, 51]])
def test_bucketed_decode_equals_per_request_attention(lens: list[int]) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    heads, kv_heads, dim, size = 6, 2, 16, 4096
    pool = MHATokenToKVPool(size, 1, torch.float32, kv_heads, dim, 1)
    rows = ReqToTokenPool(len(lens), max(lens) + 1)
    slots = rng.sample(range(1, size + 1), sum(lens))  # scattered, as after many allocations
    start = 0
    for i, n in enumerate(lens):
        rows.req_to_token[i + 1, :n] = torch.tensor(slots[start : start + n])
        start += n
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]))
    b = len(lens)
    new_loc = torch.tensor([int(rows.req_to_token[i + 1, n - 1]) for i, n in enumerate(lens)])
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=b, input_ids=torch.zeros(b, dtype=torch.int64),
        positions=torch.tensor(lens) - 1, seq_lens=torch.tensor(lens), req_pool_indices=torch.arange(1, b + 1),
        out_cache_loc=new_loc, seq_lens_cpu=list(lens), req_to_token_pool=rows, token_to_kv_pool=pool,
    )
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(fb)
    layer = RadixAttention(heads, dim, dim**-0.5, kv_heads, 0)
    q, k, v = torch.randn(b, heads, dim), torch.randn(b, kv_heads, dim), torch.randn(b, kv_heads, dim)
    out = backend.forward(q, k, v, layer, fb)
    for i, n in enumerate(lens):
        idx = rows.req_to_token[i + 1, :n]
        keys = pool.k_buffer[0][idx].repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        vals = pool.v_buffer[0][idx].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], keys) * dim**-0.5
        ref = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
        assert torch.allclose(out[i], ref, atol=1e-5), i
