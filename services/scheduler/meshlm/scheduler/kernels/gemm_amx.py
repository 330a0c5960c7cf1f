"""Dense bf16 linears for decode batches on AMX CPUs (csrc/gemm_amx.c).

There oneDNN's bf16 GEMM reads a decode batch's weights at about half the bandwidth two cores
get; this kernel holds each weight in the order its tile multiplies read it (one sequential
stream a 16-column block) and reads it once a step for batches of up to 64 rows. Prompt chunks
stay on oneDNN, whose blocking wins once the product is bound by the multiplies
(`python bench/bench_gemm_bf16.py` has both, interleaved).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library
from meshlm.scheduler.kernels.cpu_features import cpu_flags, cpu_has_amx_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemm_amx.c"
TILE_N = 16  # output columns a column block (csrc/gemm_amx.c)
TILE_K = 32  # k a tile row
# Batches of up to this many rows go through the kernel, larger ones through oneDNN.
AMX_GEMM_MAX_ROWS = 64


@dataclass(frozen=True)
class AmxWeight:
    """A [out_features, in_features] weight rounded to bf16, in the kernel's tile order."""

    data: torch.Tensor
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def packable(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape (whole column blocks and k-chunks)."""
    return out_features > 0 and in_features > 0 and out_features % TILE_N == 0 and in_features % TILE_K == 0


class AmxGemmBf16:
    """ctypes binding; `pack` and `gemm` check shapes before handing pointers to C."""

    max_rows = AMX_GEMM_MAX_ROWS

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not lib.meshlm_gemm_amx_available():
            raise KernelUnavailable("the AMX GEMM needs AMX-BF16 in this build and CPU, and the OS's permission")
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._pack = lib.meshlm_gemm_amx_pack
        self._pack.argtypes = [p, i64, i64, p]
        self._pack.restype = c_int
        self._gemm = lib.meshlm_gemm_amx
        self._gemm.argtypes = [p, i64, i64, p, i64, i64, p, p, c_int]
        self._gemm.restype = c_int

    def pack(self, weight: torch.Tensor) -> AmxWeight:
        """weight [N, K] (any float dtype; rounded to bf16) in the kernel's layout."""
        n, k = weight.shape
        if not packable(n, k):
            raise ValueError(
                f"AMX GEMM needs out_features % {TILE_N} == 0 and in_features % {TILE_K} == 0, got [{n}, {k}]"
            )
        w = weight.detach().to(torch.bfloat16).contiguous()
        data = torch.empty(n * k, dtype=torch.bfloat16)
        if self._pack(w.data_ptr(), n, k, data.data_ptr()):
            raise ValueError(f"AMX GEMM cannot pack a [{n}, {k}] weight")
        return AmxWeight(data, n, k)

    def gemm(self, x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 @ weight^T (+ bias, float32 [N]) -> bf16 [M, N]."""
        m, k = x.shape
        n = weight.out_features
        if x.dtype != torch.bfloat16 or k != weight.in_features:
            raise ValueError(f"AMX GEMM needs bf16 x [M, {weight.in_features}], got {x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (n,)):
            raise ValueError(f"AMX GEMM bias must be a contiguous float32 [{n}]")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((m, n), dtype=torch.bfloat16)
        if m == 0:
            return out
        rc = self._gemm(
            x.data_ptr(),
            x.stride(0),
            m,
            weight.data.data_ptr(),
            n,
            k,
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc:
            raise ValueError(f"AMX GEMM: unsupported shape {tuple(x.shape)} x [{n}, {k}] (rc {rc})")
        return out


@functools.lru_cache(maxsize=1)
def load_gemm_amx() -> AmxGemmBf16:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    return AmxGemmBf16(load_library(SOURCE))


def gemm_amx_or_none(flags: frozenset[str] | None = None) -> AmxGemmBf16 | None:
    """The kernel on CPUs with AMX-BF16, else None."""
    flags = cpu_flags() if flags is None else flags
    if not cpu_has_amx_bf16(flags):
        return None
    try:
        return load_gemm_amx()
    except KernelUnavailable as e:
        log.warning("AMX GEMM unavailable, oneDNN takes the bf16 decode linears: %s", e)
        return None
