"""Dense bf16 linears for decode batches on AMX CPUs (csrc/gemm_amx.c).

There oneDNN's bf16 GEMM reads a decode batch's weights at about half the bandwidth two cores
get; this kernel holds each weight in the order its tile multiplies read it (one sequential
stream a 16-column block) and reads it once a step for batches of up to 128 rows. Prompt chunks
stay on oneDNN, whose blocking wins once the product is bound by the multiplies
(`python bench/bench_gemm_bf16.py` has both, interleaved).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library
from meshlm.scheduler.kernels.cpu_features import cpu_flags, cpu_has_amx_bf16
from meshlm.scheduler.kernels.packed_gemm import PackedGemmBf16, PackedWeightBf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemm_amx.c"
TILE_N = 16  # output columns a column block (csrc/gemm_amx.c)
TILE_K = 32  # k a tile row
# Batches of up to this many rows go through the kernel, larger ones through oneDNN. Over
# SmolLM2's weights (bench_gemm_bf16.py): 0.69-0.83x oneDNN's time at 1-64 rows, 0.86-0.92x at
# 96-128; from 160 to ~900 rows a tie but for oneDNN's slow row counts (288: 0.67x, 512 and 640:
# 0.62-1.0x between runs); past ~1000 rows oneDNN's blocking wins (1024: 1.09x, 2048: 1.48x).
AMX_GEMM_MAX_ROWS = 128


def packable(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape (whole column blocks and k-chunks)."""
    return AmxGemmBf16.shape_problem(out_features, in_features) is None


class AmxGemmBf16(PackedGemmBf16):
    """ctypes binding; the shared checks (kernels/packed_gemm.py) run before C is called."""

    name = "AMX GEMM"
    layout = "amx"
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

    @staticmethod
    def shape_problem(out_features: int, in_features: int) -> str | None:
        if out_features > 0 and in_features > 0 and out_features % TILE_N == 0 and in_features % TILE_K == 0:
            return None
        return f"out_features % {TILE_N} == 0 and in_features % {TILE_K} == 0"

    def _pack_c(self, w: torch.Tensor, n: int, k: int, data: torch.Tensor) -> int:
        return int(self._pack(w.data_ptr(), n, k, data.data_ptr()))

    def _gemm_c(self, x: torch.Tensor, w: PackedWeightBf16, bias: torch.Tensor | None, out: torch.Tensor) -> int:
        m, k = x.shape
        return int(
            self._gemm(
                x.data_ptr(),
                x.stride(0),
                m,
                w.data.data_ptr(),
                w.out_features,
                k,
                0 if bias is None else bias.data_ptr(),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        )


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
