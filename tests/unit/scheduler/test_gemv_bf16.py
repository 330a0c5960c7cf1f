"""The bf16 block GEMV (kernels/csrc/gemv_bf16.c) against the float32 product of the weights its
blocks hold: q4_1 and q8_0, 1..16 rows, bias, strided rows; bad inputs refused before C."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.kernels.gemv import BLOCK, GemvOps, GemvWeight
from meshlm.scheduler.kernels.gemv_bf16 import MAX_ROWS, BlockGemvBf16, gemv_bf16_or_none


@pytest.fixture(scope="module")
def ops() -> BlockGemvBf16:
    got = gemv_bf16_or_none()
    if got is None:
        pytest.skip("no AVX512-BF16 on this CPU (or no C compiler)")
    return got


def _weight(fmt: str, n: int, k: int) -> GemvWeight:
    g = torch.Generator().manual_seed(n * k)
    blocks = n * k // BLOCK
    scales = (torch.rand(blocks, generator=g) * 0.02 + 1e-3).half().float()
    if fmt == "q8_0":
        quants = torch.randint(-127, 128, (blocks * BLOCK,), generator=g, dtype=torch.int8)
        return GemvWeight(fmt, n, k, quants, scales)
    mins = (-torch.rand(blocks, generator=g) * 0.1).half().float()
    quants = torch.randint(0, 256, (blocks * BLOCK // 2,), generator=g, dtype=torch.uint8)
    return GemvWeight(fmt, n, k, quants, scales, mins)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (576, 1536 + 32)])  # K/32 not a multiple of 16 too
def test_equals_the_float32_product(ops: BlockGemvBf16, fmt: str, rows: int, n: int, k: int) -> None:
    w = _weight(fmt, n, k)
    dense = GemvOps.dequantize(w)
    torch.manual_seed(rows)
    wide = (torch.randn(rows, k + 40) * 4).bfloat16()
    x = wide[:, 7 : 7 + k]  # rows k + 40 apart
    bias = torch.randn(n)
    for b in (None, bias):
        got = ops.gemv(x, w, b)
        want = x.float() @ dense.t() + (0 if b is None else b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # float32 sums of exact products, rounded once to bf16
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * float(want.abs().max()))


def test_bad_inputs_are_refused(ops: BlockGemvBf16) -> None:
    w = _weight("q4_1", 64, 64)
    with pytest.raises(ValueError, match="bf16 gemv needs"):
        ops.gemv(torch.zeros(2, 64), w, None)  # float32 rows
    with pytest.raises(ValueError, match="bf16 gemv needs"):
        ops.gemv(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(ValueError, match="bf16 gemv needs"):
        ops.gemv(torch.zeros(2, 32, dtype=torch.bfloat16), w, None)
    with pytest.raises(ValueError, match="bias"):
        ops.gemv(torch.zeros(2, 64, dtype=torch.bfloat16), w, torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="takes"):
        ops.gemv(torch.zeros(2, 64, dtype=torch.bfloat16), GemvWeight("f32", 64, 64, torch.zeros(64, 64)), None)
