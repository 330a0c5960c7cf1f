"""The fused CPU ops (kernels/csrc/cpu_ops.c) against the eager torch layers they replace:
float32 up to summation order, bfloat16 up to one rounding step, strided rows, in-place
residual and RoPE semantics, bad inputs rejected before C reads anything."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.cpu_ops import CpuOps, load_cpu_ops
from meshlm.scheduler.layers.activation import SiluAndMul
from meshlm.scheduler.layers.layernorm import RMSNorm
from meshlm.scheduler.layers.rotary import RotaryEmbedding

# float32: summation order only; bfloat16: the eager path rounds after every op, C once.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    try:
        return load_cpu_ops()
    except KernelUnavailable as e:  # pragma: no cover - the CI machine has gcc
        pytest.skip(f"no C compiler: {e}")


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max().clamp(min=1.0)
    assert (a.float() - b.float()).abs().max() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 runs the multi-threaded branch
def test_add_rmsnorm_matches_eager(ops: CpuOps, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    eager = RMSNorm(576, 1e-5, dtype)
    eager.weight.data = (torch.randn(576) * 0.5 + 1).to(dtype)
    x, res = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    want_out, want_res = eager(x.clone(), res.clone())
    fused = RMSNorm(576, 1e-5, dtype)
    fused.weight.data, fused.cpu_ops = eager.weight.data, ops
    got_res = res.clone()
    got_out, returned = fused(x, got_res)
    assert returned is got_res  # residual updated in place, handed back
    assert torch.equal(got_res, want_res)  # x + residual is one rounding in both
    close(got_out, want_out, dtype)
    close(fused(x), eager(x), dtype)


def test_add_rmsnorm_reads_strided_rows(ops: CpuOps) -> None:
    wide = torch.randn(5, 1000)
    x = wide[:, 100:676]  # rows 1000 apart
    w = torch.rand(576) + 0.5
    eager = RMSNorm(576, 1e-6)
    eager.weight.data = w
    close(ops.add_rmsnorm(x, None, w, 1e-6), eager(x.contiguous()), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 16)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(ops: CpuOps, dtype, heads, kv_heads, dim) -> None:
    torch.manual_seed(1)
    emb = RotaryEmbedding(dim, 4096, 10000.0)
    t = 33
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim).to(dtype)
    pos = torch.randint(0, 4096, (t,))
    q_size, kv_size = heads * dim, kv_heads * dim
    want_q, want_k = RotaryEmbedding.rotate(
        qkv[:, :q_size].reshape(t, heads, dim),
        qkv[:, q_size : q_size + kv_size].reshape(t, kv_heads, dim),
        emb.cos_sin(pos, dtype),
    )
    got = qkv.clone()
    ops.rope_neox(got, heads, kv_heads, dim, pos, emb.cos_cache, emb.sin_cache)
    close(got[:, :q_size], want_q.reshape(t, -1), dtype)
    close(got[:, q_size : q_size + kv_size], want_k.reshape(t, -1), dtype)
    assert torch.equal(got[:, q_size + kv_size :], qkv[:, q_size + kv_size :])


def test_rope_batch_paths_agree(ops: CpuOps) -> None:
    emb = RotaryEmbedding(
        64,
        128,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    pos = torch.tensor([0, 5, 127, 300])  # 300 grows the tables
    qkv = torch.randn(4, 15 * 64)
    eager = emb.batch(pos, torch.float32).rotate_qkv(qkv.clone(), 9, 3, 64)
    fused = emb.batch(pos, torch.float32, ops).rotate_qkv(qkv.clone(), 9, 3, 64)
    for a, b in zip(eager, fused, strict=True):
        assert a.shape == b.shape
        close(b, a, torch.float32)


def test_rope_rejects_a_position_outside_the_table(ops: CpuOps) -> None:
    emb = RotaryEmbedding(16, 32, 10000.0)
    qkv = torch.randn(2, 4 * 16)
    before = qkv.clone()
    with pytest.raises(IndexError, match="outside the table of 32"):
        ops.rope_neox(qkv, 2, 1, 16, torch.tensor([3, 32]), emb.cos_cache, emb.sin_cache)
    assert torch.equal(qkv, before)
    with pytest.raises(ValueError, match=r"positions must be \[2\]"):
        ops.rope_neox(qkv, 2, 1, 16, torch.tensor([3]), emb.cos_cache, emb.sin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul_matches_eager(ops: CpuOps, dtype: torch.dtype, rows: int) -> None:
    gu = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    fused = SiluAndMul()
    fused.cpu_ops = ops
    close(fused(gu), SiluAndMul()(gu), dtype)


def test_unsupported_tensors_take_the_torch_path(ops: CpuOps) -> None:
    x = torch.randn(3, 8, dtype=torch.float16)
    assert not ops.supports(x)
    norm = RMSNorm(8, params_dtype=torch.float16)
    norm.cpu_ops = ops
    assert norm(x).dtype is torch.float16
    assert not ops.supports(torch.randn(8, 3).t())  # rows not contiguous
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        ops.add_rmsnorm(torch.randn(2, 8), None, torch.ones(4), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 63), (5, 64), (64, 49152), (2, 1000)])
def test_argmax_equals_torch(ops: CpuOps, dtype: torch.dtype, rows: int, vocab: int) -> None:
    torch.manual_seed(rows * vocab)
    x = torch.randn(rows, vocab).to(dtype)
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    # Strided rows (a view of wider logits, as after slicing off padded vocab).
    wide = torch.randn(rows, vocab + 7).to(dtype)
    assert torch.equal(ops.argmax(wide[:, :vocab]), wide[:, :vocab].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_edge_values_as_torch(ops: CpuOps, dtype: torch.dtype) -> None:
    """Ties take the first index, -inf (masked tokens) and -0 / +0 compare as values, a NaN is
    the maximum and the first NaN wins: what torch.argmax returns."""
    inf, nan = float("inf"), float("nan")
    rows = [
        [1.0, 3.0, 3.0, 2.0],  # tie: first
        [-inf, -inf, -5.0, -inf],  # a grammar mask's -inf
        [-inf, -inf, -inf, -inf],  # all masked: the first
        [-0.0, 0.0, -1.0, -0.0],  # -0 == +0: the first
        [1.0, nan, 5.0, nan],  # the first NaN
        [inf, 1.0, inf, 2.0],
    ]
    x = torch.tensor(rows).to(dtype)
    want = x.argmax(dim=-1)
    assert ops.argmax(x).tolist() == want.tolist()
    # The same values far into a long row: the block scan keeps the first occurrence.
    long = torch.full((2, 500), -1.0).to(dtype)
    long[0, 130], long[0, 300], long[1, 64], long[1, 499] = 7.0, 7.0, nan, nan
    assert ops.argmax(long).tolist() == long.argmax(dim=-1).tolist() == [130, 64]
    assert ops.argmax(torch.empty(0, 5, dtype=dtype)).shape == (0,)


def test_argmax_rejects_what_it_cannot_read(ops: CpuOps) -> None:
    for bad in (torch.zeros(4), torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 0), torch.zeros(3, 4).t()):
        assert not ops.supports_argmax(bad)
        with pytest.raises(ValueError, match="argmax needs"):
            ops.argmax(bad)


def test_bf16_vector_paths_extreme_values_strides_and_odd_widths(ops: CpuOps) -> None:
    """bf16 rows of widths a multiple of 16 (add_rmsnorm's AVX-512 path) and others (the scalar
    path) agree with eager torch on strided rows; silu of a huge negative gate is ~0 (not NaN,
    as the fast-math expf made it), a NaN gate stays NaN."""
    torch.manual_seed(3)
    for width in (1536, 40):  # vector path; scalar fallback
        wide = (torch.randn(9, 2 * width + 8) * 4).bfloat16()
        gu = wide[:, 4 : 4 + 2 * width]  # rows 2 * width + 8 apart
        gu[0, :3] = torch.tensor([float("nan"), -100.0, 100.0])
        got = ops.silu_mul(gu)
        want = SiluAndMul()(gu.contiguous())
        assert got[0, 0].isnan() and want[0, 0].isnan()
        assert got[0, 1].abs() < 1e-30  # silu(-100) * up
        close(got[:, 1:], want[:, 1:], torch.bfloat16)
        close(got[1:], want[1:], torch.bfloat16)
    for hidden in (576, 40):
        eager = RMSNorm(hidden, 1e-5, torch.bfloat16)
        eager.weight.data = (torch.rand(hidden) + 0.5).bfloat16()
        wide = torch.randn(5, hidden + 16).bfloat16()
        x, res = wide[:, 8 : 8 + hidden], torch.randn(5, hidden).bfloat16()
        want_out, want_res = eager(x.contiguous(), res.clone())
        got_res = res.clone()
        got_out = ops.add_rmsnorm(x, got_res, eager.weight.data, 1e-5)
        assert torch.equal(got_res, want_res)
        close(got_out, want_out, torch.bfloat16)
