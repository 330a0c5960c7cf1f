"""Linear layers on CPU: weights laid out once at start-up for the kernel that multiplies them.

F.linear on CPU hands every call to MKL's sgemm, which re-packs the weight panel for each call;
at decode sizes (tens of rows against a few-MB weight) that packing is a large share of the
work. Each linear's weight is therefore held in a ready layout:

  * oneDNN's blocked layout for this CPU (the layout inductor's CPU weight prepacking uses; an
    opaque oneDNN tensor), for prompt chunks and whatever the kernels below do not take; or, in
    float32 where the plan's PromptGemmChoice finds MKL faster for the shape
    (layers/prompt_gemm.py), W^T for MKL's sgemm instead;
  * in float32, for decode batches, the smallest exact small format (kernels/gemv.py): a GGUF
    checkpoint's Q4_1 / Q8_0 blocks (float32 weights that are exactly such blocks, found back),
    else a dense copy. Batches of a few rows stream it through the GEMV kernels; for blocks,
    batches up to GEMM_MAX_ROWS go through the block GEMM (kernels/gemm_q.py), which reads them
    in 16-column panels (0.75 / 1.125 byte a weight where oneDNN streams 4).
  * in bfloat16, when the float32 checkpoint weight is handed over (ModelRunner loads a float32
    checkpoint in float32 for this, then casts the rest of the model) and holds GGUF blocks:
    batches of up to BF16_GEMV_MAX_ROWS rows go through the bf16 block GEMV
    (kernels/gemv_bf16.py), over the checkpoint's exact weights;
  * in bfloat16 on CPUs with AVX512-BF16 but no AMX: the bf16 panel GEMM's layout
    (kernels/gemm_bf16.py) instead of oneDNN's, for every other bf16 batch; there it beats
    oneDNN at decode sizes and ties it on prompt chunks, so no oneDNN copy is kept;
  * in bfloat16 on CPUs with AMX: also the AMX GEMM's tile order (kernels/gemm_amx.py), for
    bf16 batches of up to its max_rows (decode), beside oneDNN's copy for prompt chunks.

Results equal F.linear up to summation order (the blocks reproduce the weights bit for bit);
in bf16, oneDNN multiplies the weights rounded to bf16 and the block GEMV the exact ones.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.kernels.gemm_amx import packable as amx_packable
from meshlm.scheduler.kernels.gemm_bf16 import packable as panel_packable
from meshlm.scheduler.kernels.gemm_q import FORMATS as BLOCK_FORMATS
from meshlm.scheduler.kernels.gemm_q import GEMM_MAX_ROWS, GEMV_MAX_ROWS_BESIDE_GEMM, QPanelWeight, gemm_q_ops_or_none
from meshlm.scheduler.kernels.gemv import MAX_ROWS
from meshlm.scheduler.kernels.gemv_bf16 import FORMATS as BF16_BLOCK_FORMATS
from meshlm.scheduler.layers.prompt_gemm import PromptGemmChoice, mkl_linear

if TYPE_CHECKING:
    from meshlm.scheduler.kernels.gemm_amx import AmxGemmBf16
    from meshlm.scheduler.kernels.gemm_bf16 import PanelGemmBf16
    from meshlm.scheduler.kernels.gemv import GemvOps, GemvWeight
    from meshlm.scheduler.kernels.gemv_bf16 import BlockGemvBf16
    from meshlm.scheduler.kernels.packed_gemm import PackedWeightBf16

log = logging.getLogger(__name__)

PACK_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks the blocked layout for a typical row count: decode batches are tens of rows.
BATCH_HINT = 64
# Up to this many bf16 rows the bf16 block GEMV beats oneDNN's bf16 GEMM over all of SmolLM2's
# weights, cold (2-core AMX Xeon): 0.43x the time at 1 row, 0.52 at 2, 0.67 at 4, 1.13 at 8.
BF16_GEMV_MAX_ROWS = 4


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


@dataclass(frozen=True)
class PackPlan:
    """One prepack pass over a model's linear weights: the model's dtype (None: each weight's
    own), the small-batch kernels it may use (see PackedLinear), and the layouts it has
    self-checked so far."""

    dtype: torch.dtype | None = None
    gemv_ops: GemvOps | None = None
    gemv_bf16: BlockGemvBf16 | None = None
    gemm_bf16: PanelGemmBf16 | None = None
    gemm_amx: AmxGemmBf16 | None = None
    checks: PackChecks = field(default_factory=PackChecks)
    prompt_gemm: PromptGemmChoice = field(default_factory=PromptGemmChoice)


def try_pack(weight: torch.Tensor, bias: torch.Tensor | None, plan: PackPlan | None = None) -> PackedLinear | None:
    """A checked PackedLinear, or None where this torch build or CPU cannot pack `weight`
    (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT) or the packed result disagrees. A
    layout the plan has already checked is not checked again."""
    plan = plan or PackPlan()
    dtype = plan.dtype or weight.dtype
    if not prepack_supported() or weight.device.type != "cpu" or dtype not in PACK_DTYPES:
        return None
    try:
        packed = PackedLinear(
            weight,
            bias,
            gemv_ops=plan.gemv_ops,
            dtype=dtype,
            gemv_bf16=plan.gemv_bf16,
            gemm_bf16=plan.gemm_bf16,
            gemm_amx=plan.gemm_amx,
            prompt_gemm=plan.prompt_gemm,
        )
    except RuntimeError as e:
        log.debug("oneDNN cannot pack a %s weight here: %s", weight.dtype, e)
        return None
    layout = packed.layout()
    if layout in plan.checks.passed:
        return packed
    if not packed.matches(weight, bias):
        log.warning("oneDNN prepacked linear disagrees with F.linear here; keeping F.linear")
        return None
    plan.checks.passed.add(layout)
    return packed


class PackedLinear:
    """y = x W^T (+ b) for x [T, in] with W [out, in] held in the layouts its kernels read.

    With `gemv_ops` (float32), batches of at most `gemv_rows` rows stream W through our GEMV
    kernels: there the product is bound by reading W once, and the library GEMVs reach about
    half of the memory bandwidth two threads get (measured on an AVX2 EPYC: 9-13 vs 17-18 GB/s).
    W is held for them in the smallest exact format (`small`). When that format is GGUF blocks
    and the block GEMM runs here, batches up to GEMM_MAX_ROWS use it (`blocks`, 16-column
    panels); larger ones, and every batch of any other weight, oneDNN's prepacked weight.

    With dtype bfloat16, a float32 `weight` (the checkpoint's values) and `gemv_bf16`, a weight
    that is GGUF blocks keeps them (`small`) for bf16 batches of up to BF16_GEMV_MAX_ROWS rows;
    oneDNN gets the weight rounded to bf16.

    With dtype bfloat16 and `gemm_bf16` (a CPU with AVX512-BF16, no AMX), the weight rounded to
    bf16 is held in the panel GEMM's layout (`panels`) instead of oneDNN's (`packed` is None),
    and every bf16 batch the block GEMV does not take goes through it.

    With dtype bfloat16 and `gemm_amx` (a CPU with AMX), the weight rounded to bf16 is also held
    in the AMX GEMM's tile order (`amx`), and bf16 batches of up to gemm_amx.max_rows rows the
    block GEMV does not take go through it; larger ones through oneDNN.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_hint: int = BATCH_HINT,
        gemv_ops: GemvOps | None = None,
        dtype: torch.dtype | None = None,
        gemv_bf16: BlockGemvBf16 | None = None,
        gemm_bf16: PanelGemmBf16 | None = None,
        gemm_amx: AmxGemmBf16 | None = None,
        prompt_gemm: PromptGemmChoice | None = None,
    ) -> None:
        dtype = dtype or weight.dtype
        if weight.device.type != "cpu" or dtype not in PACK_DTYPES or weight.dim() != 2:
            raise ValueError(f"PackedLinear needs a 2-D CPU weight of {PACK_DTYPES}")
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        use_gemv = gemv_ops is not None and dtype == torch.float32
        self.gemv_ops = gemv_ops if use_gemv else None
        self.small: GemvWeight | None = gemv_ops.build(weight) if use_gemv and gemv_ops is not None else None
        self.gemm_ops = gemm_q_ops_or_none() if self.small is not None and self.small.format in BLOCK_FORMATS else None
        self.blocks: QPanelWeight | None = None
        self.gemv_rows = self.small.max_rows if self.small is not None else 0
        if self.gemm_ops is not None and self.small is not None:
            self.blocks = QPanelWeight.from_gemv(self.small)
            self.gemv_rows = min(self.gemv_rows, GEMV_MAX_ROWS_BESIDE_GEMM)
        self.gemv_bf16: BlockGemvBf16 | None = None
        self.bias_f32: torch.Tensor | None = None
        if dtype == torch.bfloat16 and weight.dtype == torch.float32 and gemv_bf16 is not None and gemv_ops is not None:
            try:
                self.small = gemv_ops.build(weight, BF16_BLOCK_FORMATS)
            except ValueError:  # not GGUF blocks: oneDNN takes every batch
                self.small = None
            if self.small is not None:
                self.gemv_bf16, self.gemv_rows = gemv_bf16, BF16_GEMV_MAX_ROWS
        self.gemm_bf16: PanelGemmBf16 | None = None
        self.panels: PackedWeightBf16 | None = None
        self.packed: torch.Tensor | None = None
        # float32 batches the kernels above do not take: oneDNN's packed weight or MKL over W^T
        # (packed once, when the choice times it or keeps oneDNN)
        self.weight_t: torch.Tensor | None = None
        pack = functools.cache(
            lambda: torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), batch_hint)
        )
        if dtype == torch.bfloat16 and gemm_bf16 is not None and panel_packable(*weight.shape):
            self.gemm_bf16, self.panels = gemm_bf16, gemm_bf16.pack(weight)
        elif dtype == torch.float32 and prompt_gemm is not None and prompt_gemm.choose(weight, bias, pack) == "mkl":
            self.weight_t = weight.detach().float().t().contiguous()
        else:
            self.packed = pack()
        self.gemm_amx: AmxGemmBf16 | None = None
        self.amx: PackedWeightBf16 | None = None
        if dtype == torch.bfloat16 and gemm_amx is not None and amx_packable(*weight.shape):
            self.gemm_amx, self.amx = gemm_amx, gemm_amx.pack(weight)
        if bias is not None and (self.gemv_bf16 is not None or self.gemm_bf16 is not None or self.amx is not None):
            self.bias_f32 = bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1])).reshape(*lead, self.out_features)
        bf16_rows = x.dtype == torch.bfloat16 and 0 < x.shape[0] <= self.gemv_rows
        if self.gemv_bf16 is not None and self.small is not None and bf16_rows:
            return self.gemv_bf16.gemv(x if x.stride(1) == 1 else x.contiguous(), self.small, self.bias_f32)
        if self.gemv_ops is not None and self.small is not None and x.dtype == torch.float32 and x.shape[0] > 0:
            rows = x if x.stride(1) == 1 else x.contiguous()
            if x.shape[0] <= self.gemv_rows:
                return self.gemv_ops.gemv(rows, self.small, self.bias)
            if self.gemm_ops is not None and self.blocks is not None and x.shape[0] <= GEMM_MAX_ROWS:
                return self.gemm_ops.gemm(rows, self.blocks, self.bias)
        if self.gemm_amx is not None and self.amx is not None and 0 < x.shape[0] <= self.gemm_amx.max_rows:
            return self.gemm_amx.gemm(x.to(torch.bfloat16), self.amx, self.bias_f32)
        if self.gemm_bf16 is not None and self.panels is not None:  # a bf16 model: bf16 activations
            return self.gemm_bf16.gemm(x.to(torch.bfloat16), self.panels, self.bias_f32)
        if self.weight_t is not None:
            return mkl_linear(x, self.weight_t, self.bias)
        assert self.packed is not None
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [None], "")

    def layout(self) -> tuple[object, ...]:
        """What decides which kernels run and how (see PackChecks)."""
        fmt = self.small.format if self.small is not None else None
        kernels = (
            self.blocks is not None,
            self.gemv_bf16 is not None,
            self.panels is not None,
            self.amx is not None,
            self.weight_t is not None,
        )
        return (self.out_features, self.in_features, self.dtype, fmt, kernels, self.bias is not None)

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Self-check against F.linear on random rows (a build whose oneDNN misbehaves on this
        CPU is not used). Draws from its own generator: the global RNG, seeded by --random-seed
        for sampling, is left untouched."""
        gen = torch.Generator().manual_seed(0)
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        small = self.gemv_rows if self.small is not None else MAX_ROWS["f32"]
        # every path; partial micro-panels and tiles (AMX: two row-block pairs, the second
        # short); two of the panel GEMM's 256-row blocks
        for rows in (max(small - 1, 1), small, 2 * small + 1, 37, 64 + 5, 256 + 3):
            x = torch.randn(rows, self.in_features, generator=gen).to(self.dtype)
            want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
            got = self(x).float()
            scale = float(want.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp(min=1))  # finite outputs only
            if not torch.allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True):
                return False
        return True


def prepack_weight(module: torch.nn.Module, with_bias: bool, plan: PackPlan | None = None) -> PackedLinear | None:
    """A PackedLinear of `module.weight` (and its bias if with_bias) as `plan` lays it out; the
    module's parameter is then an empty tensor of the packed dtype (the PackedLinear holds a
    small-batch copy of the weight only where it streams it for small batches). None when this
    torch build or CPU cannot (the module keeps its dense weight)."""
    weight, bias = module.weight, module.bias if with_bias else None
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    packed = try_pack(weight, bias, plan)
    if packed is None:
        return None
    module.weight = torch.nn.Parameter(torch.empty(0, dtype=packed.dtype), requires_grad=False)
    return packed
