"""Which library multiplies float32 prompt chunks by a linear weight: oneDNN over its
prepacked weight, or MKL's sgemm over the transposed weight W^T [K, N], timed once per weight
shape on this machine and remembered on disk.

Neither wins everywhere. On a 2-core AMD EPYC (Zen 3, AVX2; 2 threads, 2048 rows) MKL took
0.85-0.9x oneDNN's time on SmolLM2-135M's 1536->576, 576->960 and 576->576 weights and tied on
576->3072: the prompt chunks' linears 0.94x, a c=64 run (`bench/profile_engine.py --cpu-graph`)
1.00-1.04x the throughput. oneDNN is the layout inductor prepacks for and the one a bf16 model needs,
so it stays the default wherever MKL is not clearly faster.

`auto` times both at TUNE_ROWS rows (a prompt chunk's size: at a few hundred rows the two are
within noise of each other), interleaved, best of TUNE_ROUNDS, and takes MKL only when its best
time is under MKL_MARGIN of oneDNN's. The choice is kept in the kernel cache folder under a key
of the CPU (kernels/build.py cpu_fingerprint), the torch build, the thread count and the shape,
so a restart reads it back instead of timing again (the start-up log names each shape it timed);
a cache that cannot be read or written only costs the timing. Schedulers that start side by side
time under each other's load: the margin keeps oneDNN unless MKL wins clearly. Both layouts
compute the same product up to summation order.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshlm.scheduler.config import PROMPT_GEMMS

log = logging.getLogger(__name__)

TUNE_ROWS = 1024
TUNE_ROUNDS = 4
MKL_MARGIN = 0.95


def time_prompt_gemms(onednn: Callable[[], object], mkl: Callable[[], object]) -> tuple[float, float]:
    """Best seconds of one call of each, after a warm-up call each, the two alternating (a VM
    that drifts weighs on both alike)."""
    onednn(), mkl()
    best = [float("inf"), float("inf")]
    for _ in range(TUNE_ROUNDS):
        for i, fn in enumerate((onednn, mkl)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def _cache_key(n: int, k: int, bias: bool) -> str:
    from meshlm.scheduler.kernels.build import cpu_fingerprint

    text = f"{cpu_fingerprint()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{n}x{k}|bias {bias}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class PromptGemmChoice:
    """The prompt GEMM of each float32 weight shape for one prepack pass: `mode` "onednn" or "mkl"
    for every shape, or "auto" (measured per shape, remembered in `cache_dir` when given and in
    `by_shape`). Invariant: by_shape's values are "onednn" or "mkl"."""

    mode: str = "onednn"
    cache_dir: Path | None = None
    by_shape: dict[tuple[int, int, bool], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in PROMPT_GEMMS:
            raise ValueError(f"prompt_gemm must be one of {PROMPT_GEMMS}, got {self.mode!r}")

    def choose(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: Callable[[], torch.Tensor]) -> str:
        """ "onednn" or "mkl" for a float32 weight [N, K]; `pack()` gives its oneDNN layout, asked
        for only when the shape is timed (a forced or cached choice never packs)."""
        if self.mode != "auto":
            return self.mode
        n, k = weight.shape
        shape = (n, k, bias is not None)
        if shape not in self.by_shape:
            path = None if self.cache_dir is None else self.cache_dir / f"prompt-gemm-{_cache_key(*shape)}.txt"
            cached = _read_choice(path)
            self.by_shape[shape] = cached or self._measure(weight, bias, pack())
            if cached is None and path is not None:
                _write_choice(path, self.by_shape[shape])
        return self.by_shape[shape]

    def _measure(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> str:
        x = torch.randn(TUNE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
        wt = weight.detach().float().t().contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        t_onednn, t_mkl = time_prompt_gemms(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [None], ""),
            lambda: mkl_linear(x, wt, b),
        )
        choice = "mkl" if t_mkl < MKL_MARGIN * t_onednn else "onednn"
        log.info(
            "prompt GEMM of a %dx%d weight at %d rows: oneDNN %.1f ms, MKL %.1f ms -> %s",
            *weight.shape,
            TUNE_ROWS,
            1e3 * t_onednn,
            1e3 * t_mkl,
            choice,
        )
        return choice


def _read_choice(path: Path | None) -> str | None:
    """A cached choice, or None (no cache, no file, or not a choice)."""
    try:
        value = path.read_text().strip() if path is not None else None
    except OSError:
        return None
    return value if value in ("onednn", "mkl") else None


def _write_choice(path: Path, choice: str) -> None:
    """Written whole, then renamed: a concurrent reader sees all of it or nothing. A cache that
    cannot be written only costs the timing at the next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(choice + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def mkl_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) from W^T [K, N] contiguous: one sgemm without a transposed operand."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def prompt_gemm_cache_dir() -> Path | None:
    """The kernel cache folder (kernels/build.py), or None where none is writable."""
    from meshlm.scheduler.kernels.build import KernelUnavailable, cache_dir

    try:
        return cache_dir()
    except KernelUnavailable:
        return None
