"""Linear layers on CPU: weights laid out once at start-up for the kernel that multiplies them.

F.linear on CPU hands every call to MKL's sgemm, which re-packs the weight panel for each call;
at decode sizes (tens of rows against a few-MB weight) that packing is a large share of the
work. Each linear's weight is therefore held in a ready layout:

  * oneDNN's blocked layout for this CPU (the layout inductor's CPU weight prepacking uses; an
    opaque oneDNN tensor), for prompt chunks and whatever the kernels below do not take;
  * in float32, for decode batches, the smallest exact small format (kernels/gemv.py): a GGUF
    checkpoint's Q4_1 / Q8_0 blocks (float32 weights that are exactly such blocks, found back),
    else a dense copy. Batches of a few rows stream it through the GEMV kernels; for blocks,
    batches up to GEMM_MAX_ROWS go through the block GEMM (kernels/gemm_q.py), which reads them
    in 16-column panels (0.75 / 1.125 byte a weight where oneDNN streams 4).

Results equal F.linear up to summation order (the blocks reproduce the weights bit for bit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.kernels.gemm_q import FORMATS as BLOCK_FORMATS
from meshlm.scheduler.kernels.gemm_q import GEMM_MAX_ROWS, GEMV_MAX_ROWS_BESIDE_GEMM, QPanelWeight, gemm_q_ops_or_none
from meshlm.scheduler.kernels.gemv import MAX_ROWS

if TYPE_CHECKING:
    from meshlm.scheduler.kernels.gemv import GemvOps, GemvWeight

log = logging.getLogger(__name__)

PACK_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks the blocked layout for a typical row count: decode batches are tens of rows.
BATCH_HINT = 64


def prepack_supported() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass
class PackChecks:
    """The layouts whose kernels passed PackedLinear.matches in one prepack pass.

    The self-check tests that this CPU's kernels compute the product right; how they compute it
    depends on the layout (shape, dtype, small format, bias), not on the weight's values (the
    small formats are verified bit for bit when built), so one weight per layout is checked:
    a model's 30 layers share 4 layouts.
    """

    passed: set[tuple[object, ...]] = field(default_factory=set)


def try_pack(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemv_ops: GemvOps | None = None,
    checks: PackChecks | None = None,
) -> PackedLinear | None:
    """A checked PackedLinear, or None where this torch build or CPU cannot pack `weight`
    (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT) or the packed result disagrees.
    With `checks`, a layout already checked in this pass is not checked again."""
    if not prepack_supported() or weight.device.type != "cpu" or weight.dtype not in PACK_DTYPES:
        return None
    try:
        packed = PackedLinear(weight, bias, gemv_ops=gemv_ops)
    except RuntimeError as e:
        log.debug("oneDNN cannot pack a %s weight here: %s", weight.dtype, e)
        return None
    layout = packed.layout()
    if checks is not None and layout in checks.passed:
        return packed
    if not packed.matches(weight, bias):
        log.warning("oneDNN prepacked linear disagrees with F.linear here; keeping F.linear")
        return None
    if checks is not None:
        checks.passed.add(layout)
    return packed


class PackedLinear:
    """y = x W^T (+ b) for x [T, in] with W [out, in] held in the layouts its kernels read.

    With `gemv_ops` (float32), batches of at most `gemv_rows` rows stream W through our GEMV
    kernels: there the product is bound by reading W once, and the library GEMVs reach about
    half of the memory bandwidth two threads get (measured on an AVX2 EPYC: 9-13 vs 17-18 GB/s).
    W is held for them in the smallest exact format (`small`). When that format is GGUF blocks
    and the block GEMM runs here, batches up to GEMM_MAX_ROWS use it (`blocks`, 16-column
    panels); larger ones, and every batch of any other weight, oneDNN's prepacked weight.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_hint: int = BATCH_HINT,
        gemv_ops: GemvOps | None = None,
    ) -> None:
        if weight.device.type != "cpu" or weight.dtype not in PACK_DTYPES or weight.dim() != 2:
            raise ValueError(f"PackedLinear needs a 2-D CPU weight of {PACK_DTYPES}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach().contiguous()
        use_gemv = gemv_ops is not None and weight.dtype == torch.float32
        self.gemv_ops = gemv_ops if use_gemv else None
        self.small: GemvWeight | None = gemv_ops.build(weight) if use_gemv and gemv_ops is not None else None
        self.gemm_ops = gemm_q_ops_or_none() if self.small is not None and self.small.format in BLOCK_FORMATS else None
        self.blocks: QPanelWeight | None = None
        self.gemv_rows = self.small.max_rows if self.small is not None else 0
        if self.gemm_ops is not None and self.small is not None:
            self.blocks = QPanelWeight.from_gemv(self.small)
            self.gemv_rows = min(self.gemv_rows, GEMV_MAX_ROWS_BESIDE_GEMM)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1])).reshape(*lead, self.out_features)
        if self.gemv_ops is not None and self.small is not None and x.dtype == torch.float32 and x.shape[0] > 0:
            rows = x if x.stride(1) == 1 else x.contiguous()
            if x.shape[0] <= self.gemv_rows:
                return self.gemv_ops.gemv(rows, self.small, self.bias)
            if self.gemm_ops is not None and self.blocks is not None and x.shape[0] <= GEMM_MAX_ROWS:
                return self.gemm_ops.gemm(rows, self.blocks, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [None], "")

    def layout(self) -> tuple[object, ...]:
        """What decides which kernels run and how (see PackChecks)."""
        fmt = self.small.format if self.small is not None else None
        return (self.out_features, self.in_features, self.dtype, fmt, self.blocks is not None, self.bias is not None)

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Self-check against F.linear on random rows (a build whose oneDNN misbehaves on this
        CPU is not used). Draws from its own generator: the global RNG, seeded by --random-seed
        for sampling, is left untouched."""
        gen = torch.Generator().manual_seed(0)
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        small = self.gemv_rows if self.small is not None else MAX_ROWS["f32"]
        for rows in (small - 1, 2 * small + 1, 64 + 5):  # every path; partial micro-panels
            x = torch.randn(rows, self.in_features, generator=gen).to(self.dtype)
            want = torch.nn.functional.linear(x, weight, bias).float()
            got = self(x).float()
            scale = float(want.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp(min=1))  # finite outputs only
            if not torch.allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True):
                return False
        return True


def prepack_weight(
    module: torch.nn.Module, with_bias: bool, gemv_ops: GemvOps | None = None, checks: PackChecks | None = None
) -> PackedLinear | None:
    """A PackedLinear of `module.weight` (and its bias if with_bias); the module's parameter is
    then an empty tensor of its dtype (the PackedLinear holds a small-batch copy of the weight
    only where it streams it for small batches). None when this torch build or CPU cannot (the module keeps its dense
    weight)."""
    weight, bias = module.weight, module.bias if with_bias else None
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    packed = try_pack(weight, bias, gemv_ops, checks)
    if packed is None:
        return None
    module.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    return packed
