"""Small-batch linears of a bf16 model over the checkpoint's GGUF blocks (csrc/gemv_bf16.c).

A bf16 model loaded from a GGUF checkpoint holds weights that are exactly Q4_1 / Q8_0 blocks in
float32 (kernels/gemv.py finds them back). Its decode batches of a few rows are bound by
reading the weights: 0.75 byte a weight in q4_1 against 2 for the bf16 copy oneDNN reads. With
AVX512-BF16 each block's dot product is one VDPBF16PS over bf16 activations (see the C file);
the output is bf16, the weights the checkpoint's own (not their bf16 roundings).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library
from meshlm.scheduler.kernels.gemv import BLOCK, GemvWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemv_bf16.c"
MAX_ROWS = 16  # csrc/gemv_bf16.c: MAX_ROWS
FORMATS = ("q4_1", "q8_0")


class BlockGemvBf16:
    """ctypes binding; `gemv` checks shapes before handing pointers to C."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not lib.meshlm_gemv_bf16_available():
            raise KernelUnavailable("the bf16 block GEMV needs AVX512-BF16, which this build or CPU lacks")
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._fn = lib.meshlm_gemv_blocks_bf16
        self._fn.argtypes = [p, i64, p, p, p, c_int, p, p, c_int, i64, c_int, c_int]
        self._fn.restype = c_int

    def gemv(self, x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [1..MAX_ROWS, K] bf16 (rows contiguous) @ weight^T (+ bias, float32 [N]) -> bf16
        [M, N]; weight in q4_1 or q8_0."""
        m, k = x.shape
        n = weight.out_features
        if x.dtype != torch.bfloat16 or k != weight.in_features or x.stride(1) != 1 or not 1 <= m <= MAX_ROWS:
            raise ValueError(f"bf16 gemv needs bf16 x [1..{MAX_ROWS}, {weight.in_features}] with contiguous rows")
        if weight.format not in FORMATS or weight.scales is None or k % BLOCK:
            raise ValueError(f"bf16 gemv takes {FORMATS} weights, not {weight.format}")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (n,)):
            raise ValueError(f"bf16 gemv bias must be a contiguous float32 [{n}]")
        is_q4 = weight.format == "q4_1"
        if is_q4 and weight.mins is None:
            raise ValueError("a q4_1 weight needs its mins")
        out = torch.empty((m, n), dtype=torch.bfloat16)
        rc = self._fn(
            x.data_ptr(),
            x.stride(0),
            weight.scales.data_ptr(),
            weight.mins.data_ptr() if is_q4 and weight.mins is not None else None,
            weight.quants.data_ptr(),
            int(is_q4),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        if rc == 3:
            raise MemoryError("bf16 gemv: scratch memory could not be allocated")
        if rc:
            raise ValueError(f"bf16 gemv: unsupported shape {tuple(x.shape)} x {weight.format} [{n}, {k}] (rc {rc})")
        return out


@functools.lru_cache(maxsize=1)
def load_gemv_bf16() -> BlockGemvBf16:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    return BlockGemvBf16(load_library(SOURCE))


def gemv_bf16_or_none() -> BlockGemvBf16 | None:
    """load_gemv_bf16(), or None (logged) where this CPU or build has no AVX512-BF16."""
    try:
        return load_gemv_bf16()
    except KernelUnavailable as e:
        log.info("bf16 block GEMV unavailable (%s); bf16 decode linears use oneDNN", e)
        return None
