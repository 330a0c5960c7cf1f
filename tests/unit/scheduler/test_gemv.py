"""The small-batch GEMV kernels (kernels/gemv.py): a float32 weight that is a dequantized GGUF
Q4_1 / Q8_0 tensor is found back bit for bit, any other weight stays dense, and every format's
product equals F.linear up to summation order for 1..GEMV_MAX_ROWS rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.gemv import GEMV_MAX_ROWS, GemvOps, load_gemv_ops


@pytest.fixture(scope="module")
def ops() -> GemvOps:
    try:
        return load_gemv_ops()
    except KernelUnavailable as e:
        pytest.skip(f"no C compiler here: {e}")


def gguf_weight(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """What loading a GGUF tensor of `qtype` yields: gguf's own quantize, then its dequantize."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * scale).astype(np.float32)
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).copy())


@pytest.mark.parametrize(
    ("qtype", "fmt", "bytes_per_weight"),
    [(GGMLQuantizationType.Q4_1, "q4_1", 0.75), (GGMLQuantizationType.Q8_0, "q8_0", 1.125)],
)
def test_dequantized_gguf_weights_are_found_back_exactly(
    ops: GemvOps, qtype: GGMLQuantizationType, fmt: str, bytes_per_weight: float
) -> None:
    w = gguf_weight(qtype, 200, 192)
    g = ops.build(w)
    assert g.format == fmt
    assert torch.equal(ops.dequantize(g), w)  # bit for bit
    assert g.nbytes() == int(w.numel() * bytes_per_weight)


def test_tiny_and_constant_blocks_are_exact(ops: GemvOps) -> None:
    """Blocks whose scale is a float16 subnormal, and constant blocks (scale 0)."""
    w = gguf_weight(GGMLQuantizationType.Q4_1, 8, 64, scale=1e-6)
    w[3] = 0.25  # constant rows: every block has max == min
    w[5] = 0.0
    g = ops.build(w)
    assert g.format == "q4_1" and torch.equal(ops.dequantize(g), w)


def test_other_weights_stay_dense(ops: GemvOps) -> None:
    w = gguf_weight(GGMLQuantizationType.Q4_1, 64, 96)
    w[10, 17] = torch.nextafter(w[10, 17], torch.tensor(1.0))  # one value off the Q4_1 grid
    assert ops.build(w).format == "f32"
    assert ops.build(torch.randn(64, 96)).format == "f32"  # a real float32 weight
    assert ops.build(gguf_weight(GGMLQuantizationType.Q4_1, 8, 96)[:, :80].contiguous()).format == "f32"  # K % 32
    bad = gguf_weight(GGMLQuantizationType.Q8_0, 8, 64)
    bad[0, 0] = float("inf")
    assert ops.build(bad).format == "f32"


def test_formats_are_tried_in_the_order_given(ops: GemvOps) -> None:
    w = gguf_weight(GGMLQuantizationType.Q4_1, 16, 64)
    assert ops.build(w).format == "q4_1"
    assert ops.build(w, ("q8_0", "f32")).format in ("q8_0", "f32")
    assert ops.build(w, ("f32",)).format == "f32"
    with pytest.raises(ValueError, match="no format"):
        ops.build(torch.randn(16, 64), ("q4_1",))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "f32"])
@pytest.mark.parametrize("rows", list(range(1, GEMV_MAX_ROWS + 1)))
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_f_linear(ops: GemvOps, fmt: str, rows: int, bias: bool) -> None:
    qtype = GGMLQuantizationType.Q8_0 if fmt == "q8_0" else GGMLQuantizationType.Q4_1
    w = gguf_weight(qtype, 300, 160, seed=rows)
    g = ops.build(w, (fmt, "f32"))
    assert g.format == fmt
    b = torch.randn(300) if bias else None
    wide = torch.randn(rows, 400)
    x = wide[:, 100:260]  # strided rows, as a view of a wider activation
    want = torch.nn.functional.linear(x, w, b)
    assert torch.allclose(ops.gemv(x, g, b), want, atol=1e-5, rtol=1e-5)


def test_gemv_rejects_bad_shapes(ops: GemvOps) -> None:
    g = ops.build(gguf_weight(GGMLQuantizationType.Q4_1, 8, 64))
    with pytest.raises(ValueError, match="gemv needs"):
        ops.gemv(torch.randn(GEMV_MAX_ROWS + 1, 64), g, None)
    with pytest.raises(ValueError, match="gemv needs"):
        ops.gemv(torch.randn(1, 32), g, None)
    with pytest.raises(ValueError, match="bias"):
        ops.gemv(torch.randn(1, 64), g, torch.randn(7))
