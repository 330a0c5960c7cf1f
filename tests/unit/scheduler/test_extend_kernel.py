"""The C extend-attention kernel (attention/csrc/extend_attention.c) equals causal attention in
float64 over each segment's own slots, read in place from a scattered pool: across GQA groups
(one work item holding many positions, or one position of many heads), head dims, pool dtypes,
prefixes spanning several key blocks, segment lengths off the block sizes and peaked softmaxes.
It writes only its segments' rows, and refuses out-of-range slots and segments before reading."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.attention.cpu_kernel import KernelUnavailable
from meshlm.scheduler.attention.extend_kernel import ExtendKernel, ExtendSegments, load_extend_kernel

SENTINEL = 7.0


@pytest.fixture(scope="module")
def kernel() -> ExtendKernel:
    try:
        return load_extend_kernel()
    except KernelUnavailable as e:  # pragma: no cover - the CI machine has gcc and AVX2
        pytest.skip(f"extend kernel unavailable: {e}")


def _case(segments: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, q_scale=1.0):
    """(q, k_buf, v_buf, table, ExtendSegments) for (prefix, new) segments over scattered slots;
    segment i is table row i + 1 and its rows of q follow the previous segment's."""
    g = torch.Generator().manual_seed(len(segments) * 131 + heads * 7 + dim)
    total = sum(p + n for p, n in segments)
    slots = torch.randperm(total + 50, generator=g)[:total] + 1
    k_buf = torch.randn(total + 51, kv_heads, dim, generator=g).to(dtype)
    v_buf = torch.randn(total + 51, kv_heads, dim, generator=g).to(dtype)
    table = torch.zeros(len(segments) + 1, max(p + n for p, n in segments) + 3, dtype=torch.int64)
    at, start = 0, 0
    rows, prefix, starts, lens = [], [], [], []
    for i, (p, n) in enumerate(segments):
        table[i + 1, : p + n] = slots[at : at + p + n]
        at += p + n
        rows.append(i + 1), prefix.append(p), starts.append(start), lens.append(n)
        start += n
    q = torch.randn(start, heads, dim, generator=g) * q_scale
    return q, k_buf, v_buf, table, ExtendSegments.of(rows, prefix, starts, lens)


def _reference(q, k_buf, v_buf, table, seg: ExtendSegments, scale: float) -> torch.Tensor:
    out = torch.full(q.shape, SENTINEL, dtype=torch.float64)
    for row, p, s, n in zip(*(t.tolist() for t in (seg.rows, seg.prefix, seg.starts, seg.lens))):
        idx = table[row, : p + n]
        group = q.shape[1] // k_buf.shape[1]
        keys = k_buf[idx].double().repeat_interleave(group, dim=1)  # [p + n, H, D]
        vals = v_buf[idx].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ahd,khd->hak", q[s : s + n].double(), keys) * scale
        visible = torch.arange(p + n)[None, :] <= (torch.arange(n)[:, None] + p)  # [n, p + n]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[s : s + n] = torch.einsum("hak,khd->ahd", probs, vals)
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (8, 8, 128), (28, 4, 128), (4, 1, 16), (64, 1, 32), (2, 2, 256), (6, 2, 80), (100, 1, 48)],
)
def test_matches_causal_attention_across_shapes(kernel: ExtendKernel, heads: int, kv_heads: int, dim: int) -> None:
    segments = [(0, 37), (130, 61), (5, 9), (0, 100)]  # prefixes over several key blocks, odd lengths
    q, k_buf, v_buf, table, seg = _case(segments, heads, kv_heads, dim, torch.float32)
    out = torch.full(q.shape, SENTINEL)
    kernel(q, k_buf, v_buf, table, seg, dim**-0.5, out)
    torch.testing.assert_close(out.double(), _reference(q, k_buf, v_buf, table, seg, dim**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reads_16_bit_pools(kernel: ExtendKernel, dtype: torch.dtype) -> None:
    q, k_buf, v_buf, table, seg = _case([(20, 70), (0, 13)], 9, 3, 64, dtype)
    out = torch.empty(q.shape)
    kernel(q, k_buf, v_buf, table, seg, 0.125, out)
    torch.testing.assert_close(out.double(), _reference(q, k_buf, v_buf, table, seg, 0.125), rtol=1e-5, atol=1e-5)


def test_peaked_softmax_is_stable(kernel: ExtendKernel) -> None:
    """Scores in the hundreds: the running max keeps every exp finite."""
    q, k_buf, v_buf, table, seg = _case([(90, 60)], 9, 3, 64, torch.float32, q_scale=40.0)
    out = torch.empty(q.shape)
    kernel(q, k_buf, v_buf, table, seg, 0.125, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(q, k_buf, v_buf, table, seg, 0.125), rtol=1e-4, atol=1e-4)


def test_writes_only_its_segments_rows_and_reads_strided_queries(kernel: ExtendKernel) -> None:
    """Segments need not cover q; q may be a view into a fused qkv row (rows farther apart)."""
    q, k_buf, v_buf, table, seg = _case([(4, 30), (0, 20)], 9, 3, 64, torch.float32)
    only_second = ExtendSegments(seg.rows[1:], seg.prefix[1:], seg.starts[1:], seg.lens[1:])
    fused = torch.randn(q.shape[0], 15, 64)
    fused[:, :9] = q
    out = torch.full(q.shape, SENTINEL)
    kernel(fused[:, :9], k_buf, v_buf, table, only_second, 0.125, out)
    assert (out[:30] == SENTINEL).all()
    want = _reference(q, k_buf, v_buf, table, only_second, 0.125)
    torch.testing.assert_close(out[30:].double(), want[30:], rtol=1e-5, atol=1e-5)


def test_refuses_bad_slots_and_segments(kernel: ExtendKernel) -> None:
    q, k_buf, v_buf, table, seg = _case([(3, 20)], 9, 3, 64, torch.float32)
    out = torch.full(q.shape, SENTINEL)
    bad = table.clone()
    bad[1, 10] = k_buf.shape[0]  # one slot past the pool
    with pytest.raises(IndexError, match="out of range"):
        kernel(q, k_buf, v_buf, bad, seg, 0.125, out)
    too_long = ExtendSegments(seg.rows, seg.prefix, seg.starts, seg.lens + 1)  # past q's rows
    with pytest.raises(ValueError, match="segments"):
        kernel(q, k_buf, v_buf, table, too_long, 0.125, out)
    past_table = ExtendSegments(seg.rows, seg.prefix + table.shape[1], seg.starts, seg.lens)
    with pytest.raises(IndexError, match="out of range"):
        kernel(q, k_buf, v_buf, table, past_table, 0.125, out)
    assert (out == SENTINEL).all()
    assert not ExtendKernel.supports(9, 3, 24) and not ExtendKernel.supports(9, 2, 64)
    assert ExtendKernel.supports(9, 3, 64)
