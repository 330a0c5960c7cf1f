"""The bf16 panel GEMM (kernels/gemm_bf16.py): float32 sums of bf16 products rounded once, for
every tail of its tiling (groups of 1-3 panels, micro-tiles of 1-8 rows, 256-row blocks), with
and without bias, on strided and misaligned rows; the CPUs it is offered on; and PackedLinear
holding it in place of oneDNN's copy."""

from __future__ import annotations

import pytest
import torch
from bf16_gemm_testlib import bf16_reference, within_one_rounding

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.gemm_bf16 import PanelGemmBf16, gemm_bf16_or_none, load_gemm_bf16, packable
from meshlm.scheduler.layers.cpu_gemm import PackChecks, PackedLinear, PackPlan, prepack_supported, try_pack


@pytest.fixture(scope="module")
def gemm() -> PanelGemmBf16:
    try:
        return load_gemm_bf16()
    except KernelUnavailable as e:
        pytest.skip(f"no bf16 panel GEMM here: {e}")


@pytest.mark.parametrize("n", [16, 32, 48, 64, 80, 960])  # 1, 2, 3 panels; a full group + 1 or 2 panels
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 256, 257, 530])
def test_gemm_equals_the_bf16_product(gemm: PanelGemmBf16, n: int, rows: int) -> None:
    torch.manual_seed(n * 1000 + rows)
    k = 96
    w, b = torch.randn(n, k), torch.randn(n)
    x = torch.randn(rows, k).to(torch.bfloat16)
    pw = gemm.pack(w)
    assert pw.nbytes() == n * k * 2
    for bias in (None, b):
        got = gemm.gemm(x, pw, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert within_one_rounding(got, bf16_reference(x, w, bias))


def test_gemm_takes_strided_misaligned_and_empty_rows(gemm: PanelGemmBf16) -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 64)
    pw = gemm.pack(w)
    wide = torch.randn(9, 131).to(torch.bfloat16)
    for x in (wide[:, 1:65], wide[:, 2:66], wide[::2, 4:68]):  # odd start (misaligned), odd stride, every other row
        assert within_one_rounding(gemm.gemm(x, pw, None), bf16_reference(x, w, None))
    assert gemm.gemm(torch.empty(0, 64, dtype=torch.bfloat16), pw, None).shape == (0, 48)


def test_gemm_rejects_what_it_cannot_take(gemm: PanelGemmBf16) -> None:
    assert packable(32, 64) and not packable(40, 64) and not packable(32, 63) and not packable(0, 64)
    with pytest.raises(ValueError, match="out_features % 16"):
        gemm.pack(torch.randn(40, 64))
    with pytest.raises(ValueError, match="even in_features"):
        gemm.pack(torch.randn(32, 63))
    pw = gemm.pack(torch.randn(32, 64))
    with pytest.raises(ValueError, match="bf16 x"):
        gemm.gemm(torch.randn(2, 64), pw, None)  # float32 rows
    with pytest.raises(ValueError, match="bf16 x"):
        gemm.gemm(torch.randn(2, 62).to(torch.bfloat16), pw, None)
    with pytest.raises(ValueError, match="bias"):
        gemm.gemm(torch.randn(2, 64).to(torch.bfloat16), pw, torch.randn(32).to(torch.bfloat16))


def test_offered_only_on_avx512_bf16_without_amx() -> None:
    assert gemm_bf16_or_none(frozenset({"avx512f", "avx2"})) is None
    assert gemm_bf16_or_none(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})) is None
    try:
        load_gemm_bf16()
        builds = True
    except KernelUnavailable:
        builds = False
    assert (gemm_bf16_or_none(frozenset({"avx512f", "avx512_bf16"})) is not None) == builds


@pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_holds_panels_instead_of_onednn(gemm: PanelGemmBf16, rows: int) -> None:
    torch.manual_seed(rows)
    w, b = torch.randn(960, 576) * 0.05, torch.randn(960)
    lin = PackedLinear(w, b, dtype=torch.bfloat16, gemm_bf16=gemm)
    assert lin.panels is not None and lin.packed is None  # one bf16 copy of the weight, not two
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert within_one_rounding(lin(x), bf16_reference(x, w, b))
    assert lin(x.float()).dtype == torch.bfloat16  # float32 rows are multiplied as bf16
    odd = PackedLinear(torch.randn(40, 576), None, dtype=torch.bfloat16, gemm_bf16=gemm)
    assert odd.panels is None and odd.packed is not None  # not whole panels: oneDNN's layout
    f32 = PackedLinear(w, b, gemm_bf16=gemm)
    assert f32.panels is None and f32.packed is not None  # a float32 model keeps oneDNN
    plan = PackPlan(torch.bfloat16, gemm_bf16=gemm, checks=PackChecks())
    checked = try_pack(w, b, plan)  # passes the start-up self-check against F.linear
    assert checked is not None and checked.panels is not None and checked.layout() in plan.checks.passed
