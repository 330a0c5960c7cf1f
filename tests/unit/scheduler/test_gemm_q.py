"""The block GEMM (kernels/gemm_q.py): a dequantized GGUF weight re-laid into 16-column panels
holds the same weights, and its product equals F.linear up to summation order for any row
count (partial 6-row micro-panels, several 144-row tasks), any K that is a multiple of 32
(a short last K block), any N (zero-padded panels); the AVX-512 form equals the AVX2 one bit
for bit; PackedLinear dispatches by row count (GEMV, block GEMM, oneDNN for prompt chunks)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from tests.unit.scheduler.test_gemv import gguf_weight

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.gemm_q import (
    GEMM_MAX_ROWS,
    GEMV_MAX_ROWS_BESIDE_GEMM,
    NR,
    GemmQOps,
    QPanelWeight,
    load_gemm_q_ops,
)
from meshlm.scheduler.kernels.gemv import GemvOps, load_gemv_ops
from meshlm.scheduler.layers.cpu_gemm import PackedLinear

QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module")
def ops() -> tuple[GemvOps, GemmQOps]:
    try:
        return load_gemv_ops(), load_gemm_q_ops()
    except KernelUnavailable as e:
        pytest.skip(f"the block GEMM cannot run here: {e}")


def _unpanel(w: QPanelWeight) -> torch.Tensor:
    """The float32 [N, K] weight a QPanelWeight holds (reference layout arithmetic in torch)."""
    p, k = w.quants.shape[0], w.in_features
    # q4_1: [P, K, 8] nibbles -> [P, K, 16] (low nibbles columns 0..7, high 8..15)
    q = torch.cat([w.quants & 0x0F, w.quants >> 4], dim=2).float() if w.format == "q4_1" else w.quants.float()
    d = w.scales.repeat_interleave(32, dim=1)  # [P, K, 16]
    full = q * d + (w.mins.repeat_interleave(32, dim=1) if w.mins is not None else 0)
    return full.transpose(1, 2).reshape(p * NR, k)[: w.out_features]


@pytest.mark.parametrize("fmt", list(QTYPES))
def test_panels_hold_the_weight(ops, fmt: str) -> None:
    gemv, _ = ops
    w = gguf_weight(QTYPES[fmt], 40, 96)  # 40 = two full panels + a padded one
    panels = QPanelWeight.from_gemv(gemv.build(w))
    assert panels.quants.shape[0] == 3
    assert torch.equal(_unpanel(panels), w)


@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 288), (96, 576)])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64, 150, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_equals_f_linear(ops, fmt: str, n: int, k: int, rows: int, bias: bool) -> None:
    gemv, gemm = ops
    w = gguf_weight(QTYPES[fmt], n, k, seed=rows)
    panels = QPanelWeight.from_gemv(gemv.build(w))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(gemm.gemm(x, panels, b), want, rtol=1e-4, atol=1e-4)
    strided = torch.randn(rows, k + 7, generator=gen)[:, :k]  # rows further apart than K
    want = torch.nn.functional.linear(strided.double(), w.double()).float()
    torch.testing.assert_close(gemm.gemm(strided, panels, None), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 288), (96, 576), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 13, 64, 150, 300])
def test_widest_kernel_equals_avx2_bit_for_bit(ops, fmt: str, n: int, k: int, rows: int) -> None:
    """The AVX-512 kernel (two panels, 8-row micro-kernels) sums each output over the same K
    blocks in the same order of FMAs as the AVX2 one: equal bits, bias or not, for odd panel
    counts (40 = 3 panels: a lone last panel) and partial micro-panels and tasks."""
    gemv, gemm = ops
    w = gguf_weight(QTYPES[fmt], n, k, seed=rows + n)
    panels = QPanelWeight.from_gemv(gemv.build(w))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k + 3, generator=gen)[:, :k]
    b = torch.randn(n, generator=gen)
    for bias in (None, b):
        assert torch.equal(gemm.gemm(x, panels, bias), gemm.gemm(x, panels, bias, avx2=True))


def test_gemm_rejects_bad_shapes(ops) -> None:
    gemv, gemm = ops
    panels = QPanelWeight.from_gemv(gemv.build(gguf_weight(GGMLQuantizationType.Q4_1, 16, 64)))
    with pytest.raises(ValueError, match="float32 x"):
        gemm.gemm(torch.randn(3, 32), panels, None)
    with pytest.raises(ValueError, match="float32 x"):
        gemm.gemm(torch.randn(3, 64, dtype=torch.float64), panels, None)
    with pytest.raises(ValueError, match="bias"):
        gemm.gemm(torch.randn(3, 64), panels, torch.randn(15))


def test_packed_linear_holds_only_blocks_and_dispatches_by_rows(ops) -> None:
    gemv, gemm = ops
    w = gguf_weight(GGMLQuantizationType.Q4_1, 96, 128)
    b = torch.randn(96)
    lin = PackedLinear(w, b, gemv_ops=gemv)
    assert lin.packed is not None and lin.blocks is not None and lin.small is not None
    assert lin.gemv_rows == GEMV_MAX_ROWS_BESIDE_GEMM
    assert lin.matches(w, b)
    calls: list[str] = []
    lin.gemv_ops = _Spy(gemv, "gemv", calls)
    lin.gemm_ops = _Spy(gemm, "gemm", calls)
    for rows in (1, GEMV_MAX_ROWS_BESIDE_GEMM, GEMV_MAX_ROWS_BESIDE_GEMM + 1, GEMM_MAX_ROWS, GEMM_MAX_ROWS + 1):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == ["gemv", "gemv", "gemm", "gemm"]  # the last batch went to oneDNN
    dense = PackedLinear(torch.randn(96, 128), None, gemv_ops=gemv)  # not blocks: oneDNN + dense GEMV
    assert dense.packed is not None and dense.blocks is None and dense.small is not None


class _Spy:
    """Records which kernel a call went to, then runs it."""

    def __init__(self, inner: object, name: str, calls: list[str]) -> None:
        self.inner, self.name, self.calls = inner, name, calls

    def __getattr__(self, attr: str):
        fn = getattr(self.inner, attr)
        if attr != self.name:
            return fn

        def call(*args, **kwargs):
            self.calls.append(self.name)
            return fn(*args, **kwargs)

        return call
