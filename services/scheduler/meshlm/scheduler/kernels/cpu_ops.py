"""Fused elementwise ops of a decoder layer for CPUs (csrc/cpu_ops.c), called through ctypes.

A decoder layer in eager torch runs ~25 small ops (RMSNorm alone is seven: add, cast, pow,
mean, rsqrt, two multiplies), each reading and writing a temporary; at decode sizes each costs
more in dispatch than in arithmetic. Here RMSNorm with its residual add, RoPE on the packed qkv
row and SiLU·mul are one pass each. float32 and bfloat16 CPU tensors; anything else takes the
torch path (callers check `supports`). The small-batch linears are in kernels/gemv.py.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the dtype codes of our C kernels (cpu_ops.c, the decode plan)
MAX_ROW = 32768  # csrc/cpu_ops.c: the longest row (hidden size, intermediate size) it takes


def _rows(t: torch.Tensor) -> bool:
    """A [T, n] view whose rows are contiguous (any row stride)."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1)


class CpuOps:
    """ctypes bindings; every method checks shapes before handing pointers to C."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, p, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self._norm = lib.meshlm_add_rmsnorm
        self._norm.argtypes = [p, p, p, p, c_int, i64, c_int, i64, i64, i64, c_float, c_int, c_int]
        self._rope = lib.meshlm_rope_neox
        self._rope.argtypes = [p, c_int, i64, i64, c_int, c_int, c_int, p, p, p, i64, c_int]
        self._silu = lib.meshlm_silu_mul
        self._silu.argtypes = [p, p, c_int, i64, c_int, i64, i64, c_int]
        self._argmax = lib.meshlm_argmax_rows
        self._argmax.argtypes = [p, c_int, i64, i64, i64, p, c_int]
        for fn in (self._norm, self._rope, self._silu, self._argmax):
            fn.restype = c_int

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPE_CODES and _rows(x) and x.shape[-1] <= MAX_ROW

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """norm(x) without residual; else residual += x in place and norm(residual) is returned.
        x, residual: [T, H] of one dtype; weight [H] of that dtype."""
        t, h = x.shape
        if weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape != (h,):
            raise ValueError(f"RMSNorm weight must be a contiguous [{h}] {x.dtype} tensor")
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or not _rows(residual)):
            raise ValueError("RMSNorm residual must match x's shape and dtype")
        out = torch.empty((t, h), dtype=x.dtype)
        r = residual if residual is not None else x
        rc = self._norm(
            x.data_ptr(),
            r.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            DTYPE_CODES[x.dtype],
            t,
            h,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            eps,
            residual is not None,
            torch.get_num_threads(),
        )
        if rc:
            raise ValueError(f"add_rmsnorm: unsupported hidden size {h}")
        return out

    def rope_neox(
        self,
        qkv: torch.Tensor,
        num_q_heads: int,
        num_k_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate the q and k heads at the start of each qkv row [T, >= (nq + nk) * D] in place
        by positions [T] (int64), with float32 tables cos/sin [max_pos, D]."""
        t = qkv.shape[0]
        if qkv.shape[1] < (num_q_heads + num_k_heads) * head_dim:
            raise ValueError("qkv rows are shorter than the q and k heads")
        if (
            cos.dtype != torch.float32
            or sin.dtype != torch.float32
            or cos.shape != sin.shape
            or cos.shape[1] != head_dim
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError(f"RoPE tables must be contiguous float32 [max_pos, {head_dim}]")
        pos = positions.to(torch.int64).contiguous()
        if pos.shape != (t,):
            raise ValueError(f"positions must be [{t}], got {tuple(pos.shape)}")
        rc = self._rope(
            qkv.data_ptr(),
            DTYPE_CODES[qkv.dtype],
            t,
            qkv.stride(0),
            num_q_heads,
            num_k_heads,
            head_dim,
            pos.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            torch.get_num_threads(),
        )
        if rc == 3:
            raise IndexError(f"rope: a position is outside the table of {cos.shape[0]}")
        if rc:
            raise ValueError(f"rope: unsupported head_dim {head_dim}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a merged [T, 2I] row -> [T, I]."""
        t, two_i = gate_up.shape
        if two_i % 2:
            raise ValueError(f"silu_mul needs an even [gate | up] width, got {two_i}")
        out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
        rc = self._silu(
            gate_up.data_ptr(),
            out.data_ptr(),
            DTYPE_CODES[gate_up.dtype],
            t,
            two_i // 2,
            gate_up.stride(0),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc:
            raise ValueError(f"silu_mul: unsupported width {two_i}")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of a [T, V] float32 / bf16 CPU tensor with contiguous rows (the
        first index of each row's maximum; a NaN counts as the maximum): int64 [T]. The greedy
        step's argmax over [batch, vocab] logits, on every core (torch runs it on one)."""
        if not self.supports_argmax(x):
            raise ValueError(f"argmax needs [T, V >= 1] float32/bfloat16 CPU rows, got {x.dtype} {tuple(x.shape)}")
        t, v = x.shape
        out = torch.empty(t, dtype=torch.int64)
        if t:
            self._argmax(x.data_ptr(), DTYPE_CODES[x.dtype], t, v, x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    @staticmethod
    def supports_argmax(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPE_CODES and _rows(x) and x.shape[1] >= 1


@functools.lru_cache(maxsize=1)
def load_cpu_ops() -> CpuOps:
    """The ops for this machine, built on first use; raises KernelUnavailable with the reason."""
    return CpuOps(load_library(SOURCE))


def cpu_ops_or_none() -> CpuOps | None:
    """load_cpu_ops(), or None (with a warning) where the kernels cannot be built."""
    try:
        return load_cpu_ops()
    except KernelUnavailable as e:
        log.warning("fused CPU ops unavailable (%s); layers use eager torch ops", e)
        return None
