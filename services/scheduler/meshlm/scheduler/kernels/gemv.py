"""Small-batch linears (a few rows: decode batches) on CPU: csrc/gemv.c through ctypes.

At decode sizes a linear is bound by reading its weight once, so the fewer bytes per weight the
faster. `GemvWeight.build` picks the smallest exact format for a float32 weight:

  * q4_1 (0.75 byte/weight) or q8_0 (1.125) when every 32-weight block along K is exactly a
    llama.cpp Q4_1 / Q8_0 block: true of a GGUF checkpoint dequantized at load time (the default
    SmolLM2 ships as Q4_1 with a Q8_0 embedding), found back from the float32 values and
    verified bit for bit, so the product is the float32 model's up to summation order;
  * f32 (4 bytes/weight) otherwise: a dense copy streamed by a plain GEMV.

Larger batches are compute-bound and go through oneDNN (layers/cpu_gemm.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library
from meshlm.scheduler.kernels.gemv_cache import CachedBlocks, GemvBlockCache
from meshlm.scheduler.model_loader import default_cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemv.c"
GEMV_MAX_ROWS = 16  # the kernels' limit (MAX_ROWS in csrc/gemv.c)
# Up to this many rows streaming the weight beats oneDNN's blocked GEMM (`python bench/bench_gemv.py`
# on a 2-core AVX2 EPYC: q4_1 / oneDNN 0.27 at 1 row, 0.39 at 4, 0.45 at 8, 0.72 at 16; dense
# float32 0.67 at 1 row, 0.97 at 4, 1.18 at 8): a dense weight is as many bytes as oneDNN reads, so
# only the GEMV's better bandwidth counts; a quantized one is 4-5x fewer bytes.
MAX_ROWS = {"f32": 4, "q8_0": 16, "q4_1": 16}
BLOCK = 32  # weights per quantized block along K
FORMATS = ("q4_1", "q8_0", "f32")


@dataclass(frozen=True)
class GemvWeight:
    """A [N, K] float32 weight in one small-batch format.

    q4_1: scales/mins float32 [N * K/32], quants uint8 [N * K/32 * 16] (two 4-bit values a byte);
    q8_0: scales [N * K/32], quants int8 [N * K/32 * 32]; f32: quants is the dense [N, K] weight.
    Every dequantized value equals the source weight exactly.
    """

    format: str
    out_features: int
    in_features: int
    quants: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    @property
    def max_rows(self) -> int:
        """Batches of up to this many rows should take the GEMV (larger ones oneDNN)."""
        return MAX_ROWS[self.format]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins) if t is not None)


class GemvOps:
    """ctypes bindings; every method checks shapes before handing pointers to C. With a
    GemvBlockCache (kernels/gemv_cache.py) `build` reuses the blocks an earlier process
    recovered from the same weight bytes."""

    def __init__(self, lib: ctypes.CDLL, cache: GemvBlockCache | None = None) -> None:
        self.cache = cache
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._f32 = lib.meshlm_gemv_f32
        self._f32.argtypes = [p, i64, p, p, p, c_int, i64, c_int, c_int]
        self._q4 = lib.meshlm_gemv_q4_1
        self._q4.argtypes = [p, i64, p, p, p, p, p, c_int, i64, c_int, c_int]
        self._q8 = lib.meshlm_gemv_q8_0
        self._q8.argtypes = [p, i64, p, p, p, p, c_int, i64, c_int, c_int]
        self._q4_recover = lib.meshlm_q4_1_recover
        self._q4_recover.argtypes = [p, i64, c_int, p, p, p, c_int]
        self._q8_recover = lib.meshlm_q8_0_recover
        self._q8_recover.argtypes = [p, i64, c_int, p, p, c_int]
        for fn in (self._f32, self._q4, self._q8, self._q4_recover, self._q8_recover):
            fn.restype = c_int

    def build(self, weight: torch.Tensor, formats: tuple[str, ...] = FORMATS) -> GemvWeight:
        """The first of `formats` that holds the float32 [N, K] `weight` exactly ("f32" always
        does: a dense copy)."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError("GemvWeight needs a 2-D float32 CPU weight")
        w = weight.detach().contiguous()
        n, k = w.shape
        quantized = tuple(f for f in formats if f != "f32")
        if self.cache is None or k % BLOCK or not self._first_row_fits(w, quantized):
            return self._build(w, formats)  # (a first row no format holds: nothing to cache)
        key = self.cache.key(w, formats)
        hit = self.cache.load(key, n, k)
        if hit is not None and hit.format in formats:
            self.cache.stats.hits += 1
            if hit.format == "f32":  # recovery failed before: the dense copy
                return GemvWeight("f32", n, k, w)
            assert hit.quants is not None
            return GemvWeight(hit.format, n, k, hit.quants, hit.scales, hit.mins)
        t0 = time.perf_counter()
        got = self._build(w, formats)
        self.cache.stats.recover_s += time.perf_counter() - t0
        dense = got.format == "f32"
        self.cache.store(key, n, k, CachedBlocks(got.format, got.scales, got.mins, None if dense else got.quants))
        return got

    def _first_row_fits(self, w: torch.Tensor, formats: tuple[str, ...]) -> bool:
        """Whether some quantized format holds row 0 (the whole weight cannot otherwise)."""
        return any(self._recover(w[:1], fmt) is not None for fmt in formats)

    def _build(self, w: torch.Tensor, formats: tuple[str, ...]) -> GemvWeight:
        n, k = w.shape
        quantizable = k % BLOCK == 0 and bool(torch.isfinite(w).all())
        for fmt in formats:
            if fmt == "f32":
                return GemvWeight("f32", n, k, w)
            if not quantizable:
                continue
            got = self._recover(w, fmt)
            if got is not None:
                return got
        raise ValueError(f"no format among {formats} holds this weight")

    def _recover(self, w: torch.Tensor, fmt: str) -> GemvWeight | None:
        n, k = w.shape
        blocks = n * (k // BLOCK)
        scales = torch.empty(blocks, dtype=torch.float32)
        threads = torch.get_num_threads()
        if fmt == "q4_1":
            mins = torch.empty(blocks, dtype=torch.float32)
            quants = torch.empty(blocks * BLOCK // 2, dtype=torch.uint8)
            rc = self._q4_recover(w.data_ptr(), n, k, scales.data_ptr(), mins.data_ptr(), quants.data_ptr(), threads)
            return GemvWeight(fmt, n, k, quants, scales, mins) if rc == 0 else None
        if fmt == "q8_0":
            quants = torch.empty(blocks * BLOCK, dtype=torch.int8)
            rc = self._q8_recover(w.data_ptr(), n, k, scales.data_ptr(), quants.data_ptr(), threads)
            return GemvWeight(fmt, n, k, quants, scales) if rc == 0 else None
        raise ValueError(f"unknown GEMV format {fmt!r}; known: {FORMATS}")

    def gemv(self, x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M <= GEMV_MAX_ROWS, K] float32 (rows contiguous) @ weight^T (+ bias [N])."""
        m, k = x.shape
        n = weight.out_features
        if x.dtype != torch.float32 or k != weight.in_features or x.stride(1) != 1 or not 1 <= m <= GEMV_MAX_ROWS:
            raise ValueError(f"gemv needs float32 x [1..{GEMV_MAX_ROWS}, {weight.in_features}] with contiguous rows")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (n,)):
            raise ValueError(f"gemv bias must be a contiguous float32 [{n}]")
        out = torch.empty((m, n), dtype=torch.float32)
        b = 0 if bias is None else bias.data_ptr()
        threads = torch.get_num_threads()
        if weight.format == "f32":
            rc = self._f32(x.data_ptr(), x.stride(0), weight.quants.data_ptr(), b, out.data_ptr(), m, n, k, threads)
        elif weight.format == "q4_1":
            assert weight.scales is not None and weight.mins is not None
            rc = self._q4(
                x.data_ptr(),
                x.stride(0),
                weight.scales.data_ptr(),
                weight.mins.data_ptr(),
                weight.quants.data_ptr(),
                b,
                out.data_ptr(),
                m,
                n,
                k,
                threads,
            )
        else:
            assert weight.scales is not None
            rc = self._q8(
                x.data_ptr(),
                x.stride(0),
                weight.scales.data_ptr(),
                weight.quants.data_ptr(),
                b,
                out.data_ptr(),
                m,
                n,
                k,
                threads,
            )
        if rc:
            raise ValueError(f"gemv: unsupported shape {tuple(x.shape)} x {weight.format} [{n}, {k}]")
        return out

    @staticmethod
    def dequantize(weight: GemvWeight) -> torch.Tensor:
        """The float32 [N, K] weight a GemvWeight holds (for tests and checks)."""
        n, k = weight.out_features, weight.in_features
        if weight.format == "f32":
            return weight.quants
        assert weight.scales is not None
        d = weight.scales.view(-1, 1)
        if weight.format == "q8_0":
            return (weight.quants.view(-1, BLOCK).float() * d).view(n, k)
        assert weight.mins is not None
        packed = weight.quants.view(-1, BLOCK // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()  # byte j holds q_j, q_{j+16}
        return torch.addcmul(weight.mins.view(-1, 1), d, q).view(n, k)


@functools.lru_cache(maxsize=1)
def load_gemv_ops() -> GemvOps:
    """The GEMV kernels for this machine, built on first use, with the block cache in the meshlm
    cache folder (`<cache>/gemv`); raises KernelUnavailable."""
    source_id = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return GemvOps(load_library(SOURCE), GemvBlockCache(default_cache_root() / "gemv", source_id))


def gemv_ops_or_none() -> GemvOps | None:
    """load_gemv_ops(), or None (with a warning) where the kernels cannot be built."""
    try:
        return load_gemv_ops()
    except KernelUnavailable as e:
        log.warning("small-batch GEMV kernels unavailable (%s); linears use oneDNN / F.linear", e)
        return None
