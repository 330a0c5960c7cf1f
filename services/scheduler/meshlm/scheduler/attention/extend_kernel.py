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
    queries), on AMX tiles (csrc/extend_attention_amx.c); another pool dtype raises ValueError.
    store_attend also stores the batch's new K / V and may write a bf16 `out`."""

    SYMBOL = "meshlm_extend_attention_amx"
    NEEDS = "AMX-BF16 (and the OS's permission to use it)"
    Q_DTYPE = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.meshlm_extend_attention_amx_store
        fn.argtypes = [p, i64, i64, p, p, c_int, i64, i64, p, i64, i64, p, p, p, p, i64]
        fn.argtypes += [c_int, c_int, c_int, ctypes.c_float, p, i64, c_int, p, i64, p, i64, p, c_int]
        fn.restype = c_int
        self._store_fn = fn

    def store_attend(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        req_to_token: torch.Tensor,
        segments: ExtendSegments,
        scale: float,
        out: torch.Tensor,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """As __call__, with `out` float32 or bfloat16 (the float32 result rounded to nearest
        even), and, given new_kv = (k, v, loc) with k / v [T, Hkv, D] in the pool's dtype, token
        t's K / V stored into slot loc[t] first (one C pass instead of two index_put)."""
        q, hkv, seg = self._checked(q, k_buf, v_buf, req_to_token, segments)
        t, h, d = q.shape
        if out.dtype not in Q_DTYPE_CODES or out.shape != (t, h, d) or out.stride(2) != 1 or out.stride(1) != d:
            raise ValueError(f"out must be float32 or bfloat16 [{t}, {h}, {d}] with contiguous heads")
        kn = vn = loc = None
        if new_kv is not None:
            kn, vn, loc = new_kv
            for name, x in (("k", kn), ("v", vn)):
                if x.dtype != k_buf.dtype or x.shape != (t, hkv, d) or x.stride(2) != 1 or x.stride(1) != d:
                    raise ValueError(f"new {name} must be {k_buf.dtype} [{t}, {hkv}, {d}] with contiguous heads")
            loc = loc.to(torch.int64).contiguous()
            if loc.shape != (t,):
                raise ValueError(f"loc must be [{t}]")
        rc = self._store_fn(
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
            kn.data_ptr() if kn is not None else None,
            kn.stride(0) if kn is not None else 0,
            vn.data_ptr() if vn is not None else None,
            vn.stride(0) if vn is not None else 0,
            loc.data_ptr() if loc is not None else None,
            torch.get_num_threads(),
        )
        shape = f"heads/dim, pool dtype or segments (H={h}, Hkv={hkv}, D={d}, T={t}, {k_buf.dtype})"
        raise_for_status(rc, "extend", shape, "a segment or new slot", req_to_token, k_buf)
        return out

    @staticmethod
    def supports(heads: int, kv_heads: int, dim: int) -> bool:
        """Whether the kernel takes this attention shape (its pool must also be bf16)."""
        return kv_heads > 0 and heads % kv_heads == 0 and dim in AMX_HEAD_DIMS


@functools.lru_cache(maxsize=1)
def load_amx_extend_kernel() -> AmxExtendKernel:
    """The AMX kernel for this machine, built on first use; raises KernelUnavailable where the CPU
    (or the OS) has no AMX-BF16."""
    return AmxExtendKernel(load_library(AMX_SOURCE))


@functools.lru_cache(maxsize=1)
def load_extend_kernel() -> ExtendKernel:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    return ExtendKernel(load_library(SOURCE))
