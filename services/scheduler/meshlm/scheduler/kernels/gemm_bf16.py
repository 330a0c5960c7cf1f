"""Dense bf16 linears on CPUs with AVX512-BF16 but without AMX (csrc/gemm_bf16.c).

There oneDNN's bf16 GEMM streams a decode batch's weights at about half the memory bandwidth
(8-64 rows), and a prompt chunk runs at the VDPBF16PS peak either way; this kernel reads the
weight in 16-column panels, grouped by three and k-pair major, so a decode batch of a few rows
is one sequential stream and larger batches reuse each group from L2
(`python bench/bench_gemm_bf16.py`: 0.7-0.9x oneDNN's time at 4-64 rows, 0.9-1x at 256-2048).
On AMX CPUs oneDNN multiplies bf16 tiles instead, so `gemm_bf16_or_none` offers no kernel
there (not measured: no AMX machine in the sitting that added this).
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

SOURCE = Path(__file__).with_name("csrc") / "gemm_bf16.c"
PANEL = 16  # columns a panel (csrc/gemm_bf16.c)


def packable(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape (whole panels, pairs of k)."""
    return PanelGemmBf16.shape_problem(out_features, in_features) is None


class PanelGemmBf16(PackedGemmBf16):
    """ctypes binding; the shared checks (kernels/packed_gemm.py) run before C is called."""

    name = "bf16 panel GEMM"
    layout = "panels"

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not lib.meshlm_gemm_bf16_available():
            raise KernelUnavailable("the bf16 panel GEMM needs AVX512-BF16, which this build or CPU lacks")
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._pack = lib.meshlm_gemm_bf16_pack
        self._pack.argtypes = [p, i64, i64, p]
        self._pack.restype = c_int
        self._gemm = lib.meshlm_gemm_bf16
        self._gemm.argtypes = [p, i64, p, p, p, i64, i64, i64, c_int]
        self._gemm.restype = c_int

    @staticmethod
    def shape_problem(out_features: int, in_features: int) -> str | None:
        if out_features > 0 and in_features > 0 and out_features % PANEL == 0 and in_features % 2 == 0:
            return None
        return f"out_features % {PANEL} == 0 and even in_features"

    def _pack_c(self, w: torch.Tensor, n: int, k: int, data: torch.Tensor) -> int:
        return int(self._pack(w.data_ptr(), n, k, data.data_ptr()))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        # The C side reads x as int32 pairs: rows contiguous, an even stride, 4-byte aligned.
        if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            return x.clone(memory_format=torch.contiguous_format)
        return x

    def _gemm_c(self, x: torch.Tensor, w: PackedWeightBf16, bias: torch.Tensor | None, out: torch.Tensor) -> int:
        m, k = x.shape
        return int(
            self._gemm(
                x.data_ptr(),
                x.stride(0),
                w.data.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                out.data_ptr(),
                m,
                w.out_features,
                k,
                torch.get_num_threads(),
            )
        )


@functools.lru_cache(maxsize=1)
def load_gemm_bf16() -> PanelGemmBf16:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    return PanelGemmBf16(load_library(SOURCE))


def gemm_bf16_or_none(flags: frozenset[str] | None = None) -> PanelGemmBf16 | None:
    """The kernel where it beats oneDNN: AVX512-BF16 without AMX (see the module docstring)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512_bf16" not in flags or cpu_has_amx_bf16(flags):
        return None
    try:
        return load_gemm_bf16()
    except KernelUnavailable as e:
        log.warning("bf16 panel GEMM unavailable, oneDNN takes the bf16 linears: %s", e)
        return None
