"""Load and call the CPU extend-attention kernel (csrc/extend_attention.c): causal attention of
a batch's long extend segments over the paged pool, read in place (built like cpu_kernel.py's
decode kernel: for this CPU at first use, cached)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.scheduler.attention.cpu_kernel import (
    KV_DTYPE_CODES,
    Q_DTYPE_CODES,
    check_pool,
    check_table,
    raise_for_status,
)
from meshlm.scheduler.kernels.build import KernelUnavailable, load_library

__all__ = ["AmxExtendKernel", "ExtendKernel", "ExtendSegments", "load_amx_extend_kernel", "load_extend_kernel"]

SOURCE = Path(__file__).with_name("csrc") / "extend_attention.c"
AMX_SOURCE = Path(__file__).with_name("csrc") / "extend_attention_amx.c"
AMX_HEAD_DIMS = (32, 64, 96, 128)  # csrc/extend_attention_amx.c
MAX_HEAD_DIM = 256  # head dims: multiples of 16 up to this (csrc/extend_attention.c)


@dataclass(frozen=True)
class ExtendSegments:
    """The requests of an extend batch that the kernel attends, one entry per request (int64 [S]):
    its row of req_to_token, cached tokens before its new ones, first row in the batch, and
    number of new tokens (>= 1)."""

    rows: torch.Tensor
    prefix: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor

    @staticmethod
    def of(rows: list[int], prefix: list[int], starts: list[int], lens: list[int]) -> ExtendSegments:
        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64)

        return ExtendSegments(t(rows), t(prefix), t(starts), t(lens))


class ExtendKernel:
    """ctypes binding of meshlm_extend_attention (see the C file for the layouts)."""

    SYMBOL = "meshlm_extend_attention"  # the C entry; SYMBOL + "_available" says whether it runs here
    NEEDS = "AVX2 + FMA"
    Q_DTYPE = torch.float32  # the queries' dtype in C (q of another dtype is converted)

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not getattr(lib, self.SYMBOL + "_available")():
            raise KernelUnavailable(f"{self.SYMBOL} needs {self.NEEDS}, which this build or CPU lacks")
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = getattr(lib, self.SYMBOL)
        fn.argtypes = [p, i64, i64, p, p, c_int, i64, i64, p, i64, i64, p, p, p, p, i64]
        fn.argtypes += [c_int, c_int, c_int, ctypes.c_float, p, i64, c_int]
        fn.restype = c_int
        self._fn = fn

    @staticmethod
    def supports(heads: int, kv_heads: int, dim: int) -> bool:
        """Whether the kernel takes this attention shape (else the caller uses SDPA)."""
        return kv_heads > 0 and heads % kv_heads == 0 and dim % 16 == 0 and 0 < dim <= MAX_HEAD_DIM

    def _checked(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        req_to_token: torch.Tensor,
        segments: ExtendSegments,
    ) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        """q in the kernel's dtype with contiguous heads, Hkv, and the segments as int64 [S] each;
        ValueError for a pool, table or segments the kernel cannot read."""
        d = q.shape[2]
        hkv = check_pool(k_buf, v_buf, d)
        check_table(req_to_token)
        if q.dtype != self.Q_DTYPE or q.stride(2) != 1 or q.stride(1) != d:
            q = q.to(self.Q_DTYPE).contiguous()
        seg = [x.to(torch.int64).contiguous() for x in (segments.rows, segments.prefix, segments.starts, segments.lens)]
        if any(x.shape != (seg[0].shape[0],) for x in seg):
            raise ValueError("segment rows, prefix, starts and lens must be [S] each")
        return q, hkv, seg

    def __call__(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        req_to_token: torch.Tensor,
        segments: ExtendSegments,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Rows of `out` [T, H, D] float32 of each segment = the causal attention of its query rows
        of q [T, H, D] over its first prefix + a + 1 slots (query token a), with k_buf / v_buf
        [slots, Hkv, D] read in place (the batch's new K/V already stored). Other rows of `out`
        are untouched. A row, length or slot out of range raises IndexError (checked in C before
        any KV is read)."""
        q, hkv, seg = self._checked(q, k_buf, v_buf, req_to_token, segments)
        t, h, d = q.shape
        if out.dtype != torch.float32 or out.shape != (t, h, d) or out.stride(2) != 1 or out.stride(1) != d:
            raise ValueError(f"out must be float32 [{t}, {h}, {d}] with contiguous heads")
        n = seg[0].shape[0]
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            t,
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            KV_DTYPE_CODES[k_buf.dtype],
            k_buf.stride(0),
            k_buf.shape[0],
            req_to_token.data_ptr(),
            req_to_token.shape[0],
            req_to_token.stride(0),
            *(x.data_ptr() for x in seg),
            n,
            h,
            hkv,
            d,
            scale,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        shape = f"heads/dim, pool dtype or segments (H={h}, Hkv={hkv}, D={d}, T={t}, {k_buf.dtype})"
        raise_for_status(rc, "extend", shape, "a segment", req_to_token, k_buf)
        return out


class AmxExtendKernel(ExtendKernel):
    """ctypes binding of meshlm_extend_attention_amx: ExtendKernel's call for a bf16 pool (bf16
    queries), on bf16 tiles (csrc/extend_attention_amx.c: AMX's, or the same program with its
    tiles in software on AVX512-BF16), into a float32 or bf16 `out`; another pool dtype raises
    ValueError. `store` writes a batch's new K / V into a bf16 pool in C."""

    SYMBOL = "meshlm_extend_attention_amx"
    NEEDS = "AMX-BF16 (and the OS's permission to use it) or AVX512-BF16"
    Q_DTYPE = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        attend = lib.meshlm_extend_attention_amx_out
        attend.argtypes = [p, i64, i64, p, p, c_int, i64, i64, p, i64, i64, p, p, p, p, i64]
        attend.argtypes += [c_int, c_int, c_int, ctypes.c_float, p, i64, c_int, c_int]
        attend.restype = c_int
        store = lib.meshlm_kv_store_bf16
        store.argtypes = [p, p, i64, i64, p, i64, p, i64, p, i64, c_int, c_int, c_int]
        store.restype = c_int
        self._attend_out, self._store = attend, store

    def store(
        self, k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor
    ) -> None:
        """Token t's K / V (k, v [T, Hkv, D] bf16, heads contiguous, e.g. views of the packed
        qkv rows) into slot loc[t] of the bf16 pool, in one C pass (set_kv_buffer's two index_put
        took ~0.26 ms for a 2048-token chunk of SmolLM2, this ~0.05). A slot outside the pool
        raises IndexError with nothing written."""
        t, d = k.shape[0], k.shape[2]
        hkv = check_pool(k_buf, v_buf, d)
        for name, x in (("k", k), ("v", v)):
            if x.dtype != torch.bfloat16 or k_buf.dtype != torch.bfloat16:
                raise ValueError(f"store needs a bf16 pool and bf16 {name}")
            if x.shape != (t, hkv, d) or x.stride(2) != 1 or x.stride(1) != d:
                raise ValueError(f"{name} must be [{t}, {hkv}, {d}] with contiguous heads")
        loc = loc.to(torch.int64).contiguous()
        if loc.shape != (t,):
            raise ValueError(f"loc must be [{t}]")
        rc = self._store(
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.stride(0),
            k_buf.shape[0],
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            loc.data_ptr(),
            t,
            hkv,
            d,
            torch.get_num_threads(),
        )
        if rc:
            raise IndexError(f"KV store: a slot of loc is outside the pool ({k_buf.shape[0]} slots)")

    def __call__(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        req_to_token: torch.Tensor,
        segments: ExtendSegments,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """ExtendKernel's call, with `out` float32 or bfloat16 (the float32 result rounded to
        nearest even, as .to(bfloat16) would: no float32 copy to convert after)."""
        q, hkv, seg = self._checked(q, k_buf, v_buf, req_to_token, segments)
        t, h, d = q.shape
        if out.dtype not in Q_DTYPE_CODES or out.shape != (t, h, d) or out.stride(2) != 1 or out.stride(1) != d:
            raise ValueError(f"out must be float32 or bfloat16 [{t}, {h}, {d}] with contiguous heads")
        rc = self._attend_out(
            q.data_ptr(),
            q.stride(0),
            t,
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            KV_DTYPE_CODES[k_buf.dtype],
            k_buf.stride(0),
            k_buf.shape[0],
            req_to_token.data_ptr(),
            req_to_token.shape[0],
            req_to_token.stride(0),
            *(x.data_ptr() for x in seg),
            seg[0].shape[0],
            h,
            hkv,
            d,
            scale,
            out.data_ptr(),
            out.stride(0),
            Q_DTYPE_CODES[out.dtype],
            torch.get_num_threads(),
        )
        shape = f"heads/dim, pool dtype or segments (H={h}, Hkv={hkv}, D={d}, T={t}, {k_buf.dtype})"
        raise_for_status(rc, "extend", shape, "a segment", req_to_token, k_buf)
        return out

    @staticmethod
    def supports(heads: int, kv_heads: int, dim: int) -> bool:
        """Whether the kernel takes this attention shape (its pool must also be bf16)."""
        return kv_heads > 0 and heads % kv_heads == 0 and dim in AMX_HEAD_DIMS


@functools.lru_cache(maxsize=1)
def load_amx_extend_kernel() -> AmxExtendKernel:
    """The bf16 tile kernel for this machine, built on first use; raises KernelUnavailable where the
    CPU has neither AMX-BF16 (with the OS's permission) nor AVX512-BF16."""
    return AmxExtendKernel(load_library(AMX_SOURCE))


@functools.lru_cache(maxsize=1)
def load_extend_kernel() -> ExtendKernel:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    return ExtendKernel(load_library(SOURCE))
