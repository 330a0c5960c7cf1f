"""Prepacked oneDNN linears (layers/cpu_gemm.py) equal F.linear up to summation order, for the
row counts of decode and prefill, with and without bias, and leave the module consistent."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.layers.cpu_gemm import PackChecks, PackedLinear, PackPlan, prepack_supported, try_pack
from meshlm.scheduler.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshlm.scheduler.layers.logits_processor import LogitsProcessor

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    w, b = torch.randn(960, 576) * 0.05, torch.randn(960) if bias else None
    x = torch.randn(rows, 576)
    got = PackedLinear(w, b)(x)
    assert got.shape == (rows, 960)
    assert torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_packed_linear_takes_any_leading_shape_and_strided_rows() -> None:
    w = torch.randn(32, 16)
    packed = PackedLinear(w, None)
    x = torch.randn(2, 3, 16)
    assert torch.allclose(packed(x), x @ w.t(), atol=1e-5)
    wide = torch.randn(4, 40)
    assert torch.allclose(packed(wide[:, 8:24]), wide[:, 8:24] @ w.t(), atol=1e-5)


def test_prepack_drops_the_dense_weight_and_keeps_results() -> None:
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 24, bias=True, params_dtype=torch.float32)
    row = RowParallelLinear(24, 16, bias=True, params_dtype=torch.float32)
    for m in (col, row):
        torch.nn.init.normal_(m.weight)
        torch.nn.init.normal_(m.bias)
    x = torch.randn(7, 16)
    want = row(col(x))
    assert col.prepack() and row.prepack()
    assert col.weight.numel() == 0 and row.weight.numel() == 0 and col.weight.dtype is torch.float32
    assert torch.allclose(row(col(x)), want, atol=1e-4, rtol=1e-4)


def test_logits_processor_head_prepacked() -> None:
    head = torch.randn(1000, 64)
    lp = LogitsProcessor(1000)
    hidden = torch.randn(3, 64)
    want = lp._project(hidden, head)
    assert lp.prepack(head)
    assert torch.allclose(lp._project(hidden, head), want, atol=1e-4, rtol=1e-4)


def test_rejects_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="2-D CPU weight"):
        PackedLinear(torch.randn(4, 4, dtype=torch.float16), None)


def test_prepack_leaves_the_global_rng_alone() -> None:
    """--random-seed seeds the global RNG before the weights load; packing must not draw from
    it (ranks pack differently shaped shards, so their unseeded sampling would drift apart)."""
    layer = ColumnParallelLinear(16, 24, params_dtype=torch.float32)
    layer.weight.data.copy_(torch.linspace(-1, 1, 16 * 24).view(24, 16))  # loaded weights, not torch.empty's
    torch.manual_seed(7)
    layer.prepack()
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


def test_self_check_copes_with_non_finite_weights() -> None:
    """A weight holding inf / NaN (a broken checkpoint) gets a verdict, not a crash: both paths
    propagate the non-finite values to the same outputs."""
    w = torch.randn(24, 16)
    w[3, 5] = float("nan")
    w[7, 2] = float("inf")
    packed = PackedLinear(w, None)
    assert packed.matches(w, None)


@pytest.mark.parametrize("rows", [1, 2, 4, 5])  # 1..4 take the GEMV kernel, 5 oneDNN
@pytest.mark.parametrize("bias", [False, True])
def test_small_batches_stream_the_weight_through_gemv(rows: int, bias: bool) -> None:
    from meshlm.scheduler.kernels.gemv import load_gemv_ops

    torch.manual_seed(rows)
    w, b = torch.randn(300, 96), torch.randn(300) if bias else None
    packed = PackedLinear(w, b, gemv_ops=load_gemv_ops())
    assert packed.small is not None and packed.small.format == "f32" and packed.matches(w, b)
    wide = torch.randn(rows, 200)
    x = wide[:, 50:146]  # strided rows, as a view of a wider activation
    assert torch.allclose(packed(x), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_one_self_check_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """PackChecks: a second weight of a checked layout is packed without checking again; a new
    layout (another shape, a bias) is checked; a failing check still refuses the weight."""
    if not prepack_supported():
        pytest.skip("no oneDNN in this torch build")
    checked: list[tuple[object, ...]] = []
    real = PackedLinear.matches

    def spy(self: PackedLinear, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        checked.append(self.layout())
        return real(self, weight, bias)

    monkeypatch.setattr(PackedLinear, "matches", spy)
    checks = PackChecks()
    for _ in range(3):
        assert try_pack(torch.randn(64, 96), None, PackPlan(checks=checks)) is not None
    assert try_pack(torch.randn(64, 96), torch.randn(64), PackPlan(checks=checks)) is not None
    assert try_pack(torch.randn(32, 96), None, PackPlan(checks=checks)) is not None
    assert len(checked) == 3 and len(set(checked)) == 3
    monkeypatch.setattr(PackedLinear, "matches", lambda self, w, b: False)
    assert try_pack(torch.randn(16, 96), None, PackPlan(checks=checks)) is None
    assert try_pack(torch.randn(64, 96), None, PackPlan(checks=PackChecks())) is None  # a fresh pass checks again
