"""GEMM over GGUF-block weights (csrc/gemm_q.c through ctypes), for decode batches past the GEMV's
rows (up to GEMM_MAX_ROWS; prompt chunks go to oneDNN).

A decode batch of tens of rows is compute-bound, yet a float32 GEMM still streams 4 bytes a
weight from memory every step; the weights of a dequantized GGUF checkpoint are exactly Q4_1 /
Q8_0 blocks (kernels/gemv.py finds them back), so this GEMM reads them in that format (0.75 /
1.125 byte a weight) and dequantizes each 256 x 16 tile once into L1 for all rows of the batch.
`QPanelWeight.from_gemv` re-lays a row-major GemvWeight into the kernel's 16-column panels.
The product equals the float32 model's up to summation order (the dequantized values are the
checkpoint's weights bit for bit). On CPUs with AVX-512 the kernel runs on 512-bit registers
(two panels at a time) and gives the same bits as its AVX2 form (`GemmQOps.gemm(avx2=True)`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library
from meshlm.scheduler.kernels.gemv import BLOCK, GemvWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemm_q.c"
NR = 16  # output columns per panel (NR in csrc/gemm_q.c)
FORMATS = {"q4_1": 0, "q8_0": 1}
# Beside this GEMM, the GEMV keeps batches of up to this many rows: streaming row-major blocks
# wins below it, the dequantize-once tiles above (all 120 linears of SmolLM2, weights cold, 2
# threads of an AVX2 EPYC: GEMM / GEMV time 1.40 at 4 rows, 1.31 at 8, 0.83 at 12, 0.66 at 16;
# GEMM / oneDNN 0.68 at 17 rows, 0.78 at 32, 0.90 at 64, 0.82 at 128).
GEMV_MAX_ROWS_BESIDE_GEMM = 8
# Past this many rows (prompt chunks) oneDNN's float32 GEMM is faster again: the weight is read
# once per many rows, so its bytes no longer matter, and oneDNN's blocking beats ours (same
# benchmark: GEMM / oneDNN 0.77 at 64 rows, 1.04 at 512, 1.20 at 2048).
GEMM_MAX_ROWS = 256


@dataclass(frozen=True)
class QPanelWeight:
    """A [N, K] weight of Q4_1 / Q8_0 blocks in 16-column panels (layouts in csrc/gemm_q.c);
    N is padded to a multiple of 16 with zero weights."""

    format: str
    out_features: int
    in_features: int
    quants: torch.Tensor  # q4_1: uint8 [P, K, 8]; q8_0: int8 [P, K, 16]
    scales: torch.Tensor  # float32 [P, K/32, 16]
    mins: torch.Tensor | None  # q4_1: float32 [P, K/32, 16]

    @staticmethod
    def from_gemv(w: GemvWeight) -> QPanelWeight:
        if w.format not in FORMATS:
            raise ValueError(f"no panel layout for GEMV format {w.format!r}")
        assert w.scales is not None
        n, k = w.out_features, w.in_features
        panels = -(-n // NR)
        pad = panels * NR - n

        def by_panel(per_block: torch.Tensor) -> torch.Tensor:
            """[N * K/32] per-block values -> [P, K/32, 16]."""
            t = torch.nn.functional.pad(per_block.view(n, k // BLOCK), (0, 0, 0, pad))
            return t.view(panels, NR, k // BLOCK).transpose(1, 2).contiguous()

        if w.format == "q8_0":
            q = torch.nn.functional.pad(w.quants.view(n, k), (0, 0, 0, pad))
            return QPanelWeight(
                "q8_0", n, k, q.view(panels, NR, k).transpose(1, 2).contiguous(), by_panel(w.scales), None
            )
        assert w.mins is not None
        packed = w.quants.view(n, k // BLOCK, BLOCK // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).view(n, k)  # byte j holds q_j, q_{j+16}
        q = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(panels, NR, k).transpose(1, 2)  # [P, K, 16]
        nibbles = (q[:, :, : NR // 2] | (q[:, :, NR // 2 :] << 4)).contiguous()  # column i low, 8 + i high
        return QPanelWeight("q4_1", n, k, nibbles, by_panel(w.scales), by_panel(w.mins))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins) if t is not None)


class GemmQOps:
    """ctypes binding; checks shapes before handing pointers to C."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not lib.meshlm_gemm_q_available():
            raise KernelUnavailable("the block GEMM needs AVX2 + FMA, which this build lacks")
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._fn = lib.meshlm_gemm_q
        self._fn_avx2 = lib.meshlm_gemm_q_avx2
        for fn in (self._fn, self._fn_avx2):
            fn.argtypes = [c_int, p, i64, i64, p, p, p, p, p, i64, i64, c_int]
            fn.restype = c_int
        self.vector_bits: int = lib.meshlm_gemm_q_vector_bits()

    def gemm(self, x: torch.Tensor, w: QPanelWeight, bias: torch.Tensor | None, avx2: bool = False) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) @ w^T (+ bias [N]) -> [M, N] float32, on the widest
        kernel of this build (`avx2`: on the AVX2 one)."""
        m, k = x.shape
        n = w.out_features
        if x.dtype != torch.float32 or k != w.in_features or x.stride(1) != 1 or m < 1:
            raise ValueError(f"gemm needs float32 x [M, {w.in_features}] with contiguous rows")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (n,)):
            raise ValueError(f"gemm bias must be a contiguous float32 [{n}]")
        out = torch.empty((m, n), dtype=torch.float32)
        rc = (self._fn_avx2 if avx2 else self._fn)(
            FORMATS[w.format],
            x.data_ptr(),
            x.stride(0),
            m,
            w.quants.data_ptr(),
            w.scales.data_ptr(),
            0 if w.mins is None else w.mins.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            k,
            torch.get_num_threads(),
        )
        if rc == 3:
            raise MemoryError("block GEMM: scratch memory could not be allocated")
        if rc:
            raise ValueError(f"block GEMM: unsupported shape {tuple(x.shape)} x {w.format} [{n}, {k}]")
        return out


@functools.lru_cache(maxsize=1)
def load_gemm_q_ops() -> GemmQOps:
    """The block GEMM for this machine, built on first use; raises KernelUnavailable."""
    return GemmQOps(load_library(SOURCE))


def gemm_q_ops_or_none() -> GemmQOps | None:
    """load_gemm_q_ops(), or None (logged) where the kernel cannot be built or run here."""
    try:
        return load_gemm_q_ops()
    except KernelUnavailable as e:
        log.info("block GEMM unavailable (%s); larger batches use oneDNN", e)
        return None
