"""The AMX decode GEMM (kernels/gemm_amx.py): float32 sums of bf16 products rounded once, for
every shape of its tiling (passes of 32 rows, the last one 1-32 rows, padded or not; pairs of
16-column blocks with an odd block left), with and without bias, on strided rows; the CPUs it
is offered on; and PackedLinear sending decode batches to it and prompt chunks to oneDNN."""

from __future__ import annotations

import pytest
import torch
from bf16_gemm_testlib import bf16_reference, within_one_rounding

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.gemm_amx import AmxGemmBf16, gemm_amx_or_none, load_gemm_amx, packable
from meshlm.scheduler.kernels.gemm_bf16 import load_gemm_bf16
from meshlm.scheduler.layers.cpu_gemm import PackChecks, PackedLinear, PackPlan, prepack_supported, try_pack


@pytest.fixture(scope="module")
def gemm() -> AmxGemmBf16:
    try:
        return load_gemm_amx()
    except KernelUnavailable as e:
        pytest.skip(f"no AMX GEMM here: {e}")


@pytest.mark.parametrize("n", [16, 32, 48, 960])  # one block, a pair, a pair + an odd block, many
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 48, 64, 71, 100])
def test_gemm_equals_the_bf16_product(gemm: AmxGemmBf16, n: int, rows: int) -> None:
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


def test_gemm_takes_strided_and_empty_rows(gemm: AmxGemmBf16) -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 64)
    pw = gemm.pack(w)
    wide = torch.randn(41, 131).to(torch.bfloat16)
    for x in (wide[:, 1:65], wide[::2, 4:68], wide[:40, 64:128]):  # row stride 131 / 262, odd start
        assert within_one_rounding(gemm.gemm(x, pw, None), bf16_reference(x, w, None))
    assert within_one_rounding(
        gemm.gemm(wide[:, 1:65].t().contiguous().t(), pw, None), bf16_reference(wide[:, 1:65], w, None)
    )
    assert gemm.gemm(torch.empty(0, 64, dtype=torch.bfloat16), pw, None).shape == (0, 48)


def test_gemm_rejects_what_it_cannot_take(gemm: AmxGemmBf16) -> None:
    assert packable(32, 64) and not packable(40, 64) and not packable(32, 48) and not packable(0, 64)
    with pytest.raises(ValueError, match="out_features % 16"):
        gemm.pack(torch.randn(40, 64))
    with pytest.raises(ValueError, match="in_features % 32"):
        gemm.pack(torch.randn(32, 48))
    pw = gemm.pack(torch.randn(32, 64))
    with pytest.raises(ValueError, match="bf16 x"):
        gemm.gemm(torch.randn(2, 64), pw, None)  # float32 rows
    with pytest.raises(ValueError, match="bf16 x"):
        gemm.gemm(torch.randn(2, 96).to(torch.bfloat16), pw, None)
    with pytest.raises(ValueError, match="bias"):
        gemm.gemm(torch.randn(2, 64).to(torch.bfloat16), pw, torch.randn(32).to(torch.bfloat16))


def test_gemm_refuses_a_weight_packed_for_another_kernel(gemm: AmxGemmBf16) -> None:
    try:
        panels = load_gemm_bf16()
    except KernelUnavailable:
        pytest.skip("no bf16 panel GEMM here")
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="packed for panels"):
        gemm.gemm(x, panels.pack(torch.randn(32, 64)), None)
    with pytest.raises(ValueError, match="packed for amx"):
        panels.gemm(x, gemm.pack(torch.randn(32, 64)), None)


def test_offered_only_with_amx() -> None:
    assert gemm_amx_or_none(frozenset({"avx512f", "avx512_bf16"})) is None
    try:
        load_gemm_amx()
        builds = True
    except KernelUnavailable:
        builds = False
    assert (gemm_amx_or_none(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})) is not None) == builds


@pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 37, 64, 65, 300])
def test_packed_linear_sends_decode_batches_to_amx(gemm: AmxGemmBf16, rows: int) -> None:
    torch.manual_seed(rows)
    w, b = torch.randn(960, 576) * 0.05, torch.randn(960)
    lin = PackedLinear(w, b, dtype=torch.bfloat16, gemm_amx=gemm)
    assert lin.amx is not None and lin.packed is not None  # oneDNN keeps the prompt chunks
    x = torch.randn(rows, 576).to(torch.bfloat16)
    got = lin(x)
    assert lin.bias_f32 is not None
    if rows <= gemm.max_rows:  # the AMX kernel's own result, bit for bit
        assert torch.equal(got, gemm.gemm(x, lin.amx, lin.bias_f32))
        assert within_one_rounding(got, bf16_reference(x, w, b))
    else:  # oneDNN's, which adds the bias to the product rounded to bf16: two roundings
        want = bf16_reference(x, w, b)
        assert bool(((got.double() - want).abs() <= want.abs() * 2**-7 + 1e-2).all())
    f32 = PackedLinear(w, b, gemm_amx=gemm)
    assert f32.amx is None  # a float32 model keeps oneDNN
    plan = PackPlan(torch.bfloat16, gemm_amx=gemm, checks=PackChecks())
    checked = try_pack(w, b, plan)  # passes the start-up self-check against F.linear
    assert checked is not None and checked.amx is not None and checked.layout() in plan.checks.passed
