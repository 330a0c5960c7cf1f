"""Load and call the fused CPU decode-attention kernel (csrc/decode_attention.c).

The C source is built for this CPU at first use (meshlm.scheduler.kernels.build: cached by
source, compiler, flags and CPU; a two-step build so -ffast-math never turns on flush-to-zero
for the process).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library

__all__ = ["DecodeKernel", "KernelUnavailable", "SUPPORTED_KV_DTYPES", "load_decode_kernel", "storable"]

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kv_dtype of the C kernels
SUPPORTED_KV_DTYPES = tuple(KV_DTYPE_CODES)
Q_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # q_dtype / out_dtype of the decode kernel


def storable(new: torch.dtype, pool: torch.dtype) -> bool:
    """Whether the decode kernel stores new K/V rows of dtype `new` into a pool of `pool`: the
    pool's own dtype, or float32 rows rounded into a bf16 pool (--kv-cache-dtype bfloat16)."""
    return new == pool or (new == torch.float32 and pool == torch.bfloat16)


def check_pool(k_buf: torch.Tensor, v_buf: torch.Tensor, d: int) -> int:
    """Raise ValueError unless k_buf / v_buf are CPU [slots, Hkv, d] buffers the kernels read
    (same strides and dtype, heads d apart); returns Hkv."""
    for name, t in (("k_buf", k_buf), ("v_buf", v_buf)):
        if t.device.type != "cpu" or t.dtype not in KV_DTYPE_CODES or t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name} must be a CPU [slots, Hkv, D] buffer of {SUPPORTED_KV_DTYPES}")
    if k_buf.stride(0) != v_buf.stride(0) or k_buf.dtype != v_buf.dtype or k_buf.shape[2] != d:
        raise ValueError("k_buf and v_buf must share shape, strides and dtype")
    return k_buf.shape[1]


def raise_for_status(
    rc: int, kernel: str, shape: str, unit: str, req_to_token: torch.Tensor, k_buf: torch.Tensor
) -> None:
    """Raise what a C kernel's return code means (the kernels share it): 1 unsupported `shape`
    (ValueError), 3 a `unit`'s row, length or KV slot out of range (IndexError), other non-zero:
    scratch memory (MemoryError)."""
    if rc == 0:
        return
    if rc == 1:
        raise ValueError(f"{kernel} kernel: unsupported {shape}")
    if rc == 3:
        raise IndexError(
            f"{kernel} kernel: {unit}'s row, length or KV slot is out of range (rows "
            f"{req_to_token.shape[0]} x {req_to_token.stride(0)}, KV slots {k_buf.shape[0]})"
        )
    raise MemoryError(f"{kernel} kernel: scratch memory could not be allocated")


def check_table(req_to_token: torch.Tensor) -> None:
    """Raise ValueError unless req_to_token is an int64 CPU table with contiguous rows."""
    if req_to_token.dtype != torch.int64 or req_to_token.stride(1) != 1 or req_to_token.device.type != "cpu":
        raise ValueError("req_to_token must be an int64 table with contiguous rows")


class DecodeKernel:
    """ctypes binding of meshlm_decode_attention_store (see the C file for the layouts)."""

    def __init__(self, lib: ctypes.CDLL, amx: bool = True) -> None:
        """`amx`: let the bf16 path score keys with AMX tiles where the CPU and kernel allow
        (the C file says when); False keeps it on AVX512-BF16 (the tests compare the two)."""
        self.path = Path(lib._name)
        fn = lib.meshlm_decode_attention_store
        i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn.argtypes = [
            p,
            c_int,
            i64,
            p,
            p,
            c_int,
            i64,
            i64,
            p,
            i64,
            i64,
            p,
            p,
            i64,
            c_int,
            c_int,
            c_int,
            ctypes.c_float,
            p,
            c_int,
            c_int,
            p,
            i64,
            p,
            i64,
            p,
            c_int,
            c_int,
        ]
        fn.restype = c_int
        self._fn = fn
        self.amx = amx

    @staticmethod
    def _rows_of_heads(t: torch.Tensor, heads: int, d: int) -> bool:
        """[B, heads, D] with heads D apart and D contiguous (rows may be any stride apart)."""
        return t.dim() == 3 and t.shape[1:] == (heads, d) and t.stride(2) == 1 and t.stride(1) == d

    def __call__(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Attention of q [B, H, D] (one token per request; float32 or bfloat16, any other dtype
        is converted to float32) over the first lens[b] slots of req_to_token[rows[b]], reading
        k_buf/v_buf [slots, Hkv, D] in place. Returns [B, H, D] of out_dtype (float32 or
        bfloat16; computed in float32, rounded once). With new_kv = (k [B, Hkv, D],
        v [B, Hkv, D], loc [B]) in the pool's dtype (or float32 for a bf16 pool: rounded to
        nearest even, as Tensor.to rounds), request b first writes its new K/V into slot loc[b]
        (the store of the decode step). A row, length or slot out of range raises IndexError
        (checked in C before any KV is read or written)."""
        b, h, d = q.shape
        hkv = check_pool(k_buf, v_buf, d)
        check_table(req_to_token)
        if q.dtype not in Q_DTYPE_CODES:
            q = q.to(torch.float32)
        if not self._rows_of_heads(q, h, d):
            q = q.contiguous()
        if out_dtype not in Q_DTYPE_CODES:
            raise ValueError(f"out_dtype must be one of {tuple(Q_DTYPE_CODES)}, got {out_dtype}")
        rows = rows.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        store: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        new_code = KV_DTYPE_CODES[k_buf.dtype]
        if new_kv is not None:
            nk, nv, loc = new_kv
            for name, t in (("new k", nk), ("new v", nv)):
                if not storable(t.dtype, k_buf.dtype) or not self._rows_of_heads(t, hkv, d) or t.shape[0] != b:
                    raise ValueError(
                        f"{name} must be [{b}, {hkv}, {d}] rows of the pool's dtype {k_buf.dtype} "
                        "(or float32 for a bfloat16 pool)"
                    )
            new_code = KV_DTYPE_CODES[nk.dtype]
            loc = loc.to(torch.int64).contiguous()
            if loc.shape != (b,):
                raise ValueError(f"loc must be [{b}], got {tuple(loc.shape)}")
            store = (nk.data_ptr(), nk.stride(0), nv.data_ptr(), nv.stride(0), loc.data_ptr())
        out = torch.empty((b, h, d), dtype=out_dtype)
        rc = self._fn(
            q.data_ptr(),
            Q_DTYPE_CODES[q.dtype],
            q.stride(0),
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            KV_DTYPE_CODES[k_buf.dtype],
            k_buf.stride(0),
            k_buf.shape[0],
            req_to_token.data_ptr(),
            req_to_token.shape[0],
            req_to_token.stride(0),
            rows.data_ptr(),
            lens.data_ptr(),
            b,
            h,
            hkv,
            d,
            scale,
            out.data_ptr(),
            Q_DTYPE_CODES[out_dtype],
            torch.get_num_threads(),
            *store,
            int(self.amx),
            new_code,
        )
        raise_for_status(rc, "decode", f"heads/dim (H={h}, Hkv={hkv}, D={d})", "a request", req_to_token, k_buf)
        return out


@functools.lru_cache(maxsize=1)
def load_decode_kernel() -> DecodeKernel:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    return DecodeKernel(load_library(SOURCE))
