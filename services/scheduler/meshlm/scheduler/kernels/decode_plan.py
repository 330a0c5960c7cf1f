"""A list of C kernel calls made in one ctypes call (csrc/decode_plan.c): a CPU decode graph.

Each builder below turns one kernel call into an Op: the kernel's address and its arguments in
the kernel's own order, with the batch's row count and the thread count left to the run. The
tensors an op points at must outlive the plan (DecodePlan keeps a reference to every one it is
given) and must not move: the plan is built over fixed buffers and replayed as is.

Argument orders mirror the kernels' C signatures (kernels/csrc/cpu_ops.c, gemm_amx.c,
gemm_bf16.c, gemv_bf16.c, gemv.c, gemm_q.c, attention/csrc/decode_attention.c) and the slots
run_op reads. The norm, RoPE, SiLU and attention ops run in the dtype of the buffers they are
given (float32 or bfloat16); each linear op's kernel has one dtype.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshlm.scheduler.attention.cpu_kernel import KV_DTYPE_CODES
from meshlm.scheduler.kernels.build import load_library
from meshlm.scheduler.kernels.cpu_ops import DTYPE_CODES
from meshlm.scheduler.kernels.gemm_q import FORMATS as BLOCK_FORMATS

if TYPE_CHECKING:
    from meshlm.scheduler.attention.cpu_kernel import DecodeKernel
    from meshlm.scheduler.kernels.cpu_ops import CpuOps
    from meshlm.scheduler.kernels.gemm_amx import AmxGemmBf16
    from meshlm.scheduler.kernels.gemm_bf16 import PanelGemmBf16
    from meshlm.scheduler.kernels.gemm_q import GemmQOps, QPanelWeight
    from meshlm.scheduler.kernels.gemv import GemvOps, GemvWeight
    from meshlm.scheduler.kernels.gemv_bf16 import BlockGemvBf16
    from meshlm.scheduler.kernels.packed_gemm import PackedWeightBf16

SOURCE = Path(__file__).with_name("csrc") / "decode_plan.c"
OP_ARGS = 26
# kinds of csrc/decode_plan.c
ADD_RMSNORM, ROPE_NEOX, SILU_MUL, GEMM_AMX, GEMM_PANEL, GEMV_BF16, DECODE_ATTN = range(7)
GEMV_F32, GEMV_Q4_1, GEMV_Q8_0, GEMM_Q = range(7, 11)
KIND_NAMES = (
    "add_rmsnorm", "rope_neox", "silu_mul", "gemm_amx", "gemm_panel", "gemv_bf16", "decode_attention",
    "gemv_f32", "gemv_q4_1", "gemv_q8_0", "gemm_q",
)  # fmt: skip
MAX_ROWS = 1 << 30  # "any batch"


def dtype_code(t: torch.Tensor) -> int:
    """The kernels' code for t's dtype (float32 or bfloat16)."""
    if t.dtype not in DTYPE_CODES:
        raise ValueError(f"the decode plan's kernels take float32 or bfloat16, not {t.dtype}")
    return DTYPE_CODES[t.dtype]


class _COp(ctypes.Structure):
    """meshlm_op of csrc/decode_plan.c."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("min_rows", ctypes.c_int32),
        ("max_rows", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("fn", ctypes.c_void_p),
        ("a", ctypes.c_int64 * OP_ARGS),
        ("f", ctypes.c_float),
    ]


@dataclass(frozen=True)
class Op:
    """One kernel call: `args` in the kernel's order without rows and threads (see module doc)."""

    kind: int
    fn: int
    args: tuple[int, ...]
    f: float = 0.0
    min_rows: int = 1
    max_rows: int = MAX_ROWS


def address(fn: Any) -> int:
    """The address of a ctypes foreign function."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return int(value)


def _ptr(t: torch.Tensor | None, offset_elems: int = 0) -> int:
    return 0 if t is None else t.data_ptr() + offset_elems * t.element_size()


def add_rmsnorm_op(
    ops: CpuOps, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor, eps: float
) -> Op:
    """CpuOps.add_rmsnorm(x, residual, w, eps) into out (residual updated in place when given)."""
    r = residual if residual is not None else x
    args = (_ptr(x), _ptr(r), _ptr(w), _ptr(out), dtype_code(x), x.shape[1], x.stride(0), r.stride(0), out.stride(0))
    return Op(ADD_RMSNORM, address(ops._norm), (*args, int(residual is not None)), eps)


def rope_op(
    ops: CpuOps,
    qkv: torch.Tensor,
    nq: int,
    nk: int,
    d: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> Op:
    """CpuOps.rope_neox over the rows of qkv at `positions` (int64)."""
    code = dtype_code(qkv)
    args = (_ptr(qkv), code, qkv.stride(0), nq, nk, d, _ptr(positions), _ptr(cos), _ptr(sin), cos.shape[0])
    return Op(ROPE_NEOX, address(ops._rope), args)


def silu_mul_op(ops: CpuOps, gate_up: torch.Tensor, out: torch.Tensor) -> Op:
    """CpuOps.silu_mul(gate_up) into out."""
    args = (_ptr(gate_up), _ptr(out), dtype_code(gate_up), out.shape[1], gate_up.stride(0), out.stride(0))
    return Op(SILU_MUL, address(ops._silu), args)


def gemm_amx_op(
    k: AmxGemmBf16,
    x: torch.Tensor,
    w: PackedWeightBf16,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    min_rows: int,
    max_rows: int,
) -> Op:
    """AmxGemmBf16.gemm(x, w, bias) into y."""
    args = (_ptr(x), x.stride(0), _ptr(w.data), w.out_features, w.in_features, _ptr(bias), _ptr(y))
    return Op(GEMM_AMX, address(k._gemm), args, min_rows=min_rows, max_rows=max_rows)


def gemm_panel_op(
    k: PanelGemmBf16,
    x: torch.Tensor,
    w: PackedWeightBf16,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    min_rows: int,
    max_rows: int,
) -> Op:
    """PanelGemmBf16.gemm(x, w, bias) into y."""
    args = (_ptr(x), x.stride(0), _ptr(w.data), _ptr(bias), _ptr(y), w.out_features, w.in_features)
    return Op(GEMM_PANEL, address(k._gemm), args, min_rows=min_rows, max_rows=max_rows)


def gemv_bf16_op(
    k: BlockGemvBf16, x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None, y: torch.Tensor, max_rows: int
) -> Op:
    """BlockGemvBf16.gemv(x, w, bias) into y, for batches of 1..max_rows rows."""
    is_q4 = w.format == "q4_1"
    assert w.scales is not None and (w.mins is not None or not is_q4)
    mins = _ptr(w.mins) if is_q4 else 0
    args = (_ptr(x), x.stride(0), _ptr(w.scales), mins, _ptr(w.quants), int(is_q4), _ptr(bias), _ptr(y))
    return Op(GEMV_BF16, address(k._fn), (*args, w.out_features, w.in_features), max_rows=max_rows)


def gemv_op(
    k: GemvOps, x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None, y: torch.Tensor, max_rows: int
) -> Op:
    """GemvOps.gemv(x, w, bias) into y (float32), for batches of 1..max_rows rows."""
    n, kk = w.out_features, w.in_features
    if w.format == "f32":
        args: tuple[int, ...] = (_ptr(x), x.stride(0), _ptr(w.quants), _ptr(bias), _ptr(y), n, kk)
        return Op(GEMV_F32, address(k._f32), args, max_rows=max_rows)
    assert w.scales is not None
    if w.format == "q4_1":
        assert w.mins is not None
        args = (_ptr(x), x.stride(0), _ptr(w.scales), _ptr(w.mins), _ptr(w.quants), _ptr(bias), _ptr(y), n, kk)
        return Op(GEMV_Q4_1, address(k._q4), args, max_rows=max_rows)
    args = (_ptr(x), x.stride(0), _ptr(w.scales), _ptr(w.quants), _ptr(bias), _ptr(y), n, kk)
    return Op(GEMV_Q8_0, address(k._q8), args, max_rows=max_rows)


def gemm_q_op(
    k: GemmQOps,
    x: torch.Tensor,
    w: QPanelWeight,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    min_rows: int,
    max_rows: int,
) -> Op:
    """GemmQOps.gemm(x, w, bias) into y (float32)."""
    args = (
        BLOCK_FORMATS[w.format], _ptr(x), x.stride(0), _ptr(w.quants), _ptr(w.scales), _ptr(w.mins),
        _ptr(bias), _ptr(y), w.out_features, w.in_features,
    )  # fmt: skip
    return Op(GEMM_Q, address(k._fn), args, min_rows=min_rows, max_rows=max_rows)


@dataclass(frozen=True)
class AttnArgs:
    """The fixed operands of one layer's decode attention (the step's rows / lens / loc live in
    the plan's int64 buffers)."""

    k_buf: torch.Tensor
    v_buf: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    loc: torch.Tensor
    scale: float


def decode_attn_op(k: DecodeKernel, qkv: torch.Tensor, h: int, hkv: int, d: int, a: AttnArgs, out: torch.Tensor) -> Op:
    """DecodeKernel(q, ..., new_kv=(k, v, loc), out_dtype=out.dtype) with q, k and v the heads
    of the rows of qkv ([q | k | v], heads d apart), into out [B, h * d] (float32 or bf16). The
    pool is of qkv's dtype, or bf16 under a float32 qkv (the kernel rounds the new rows)."""
    kv_code, new_code = KV_DTYPE_CODES[a.k_buf.dtype], KV_DTYPE_CODES[qkv.dtype]
    table = a.req_to_token
    args = (
        _ptr(qkv), dtype_code(qkv), qkv.stride(0),
        _ptr(a.k_buf), _ptr(a.v_buf), kv_code, a.k_buf.stride(0), a.k_buf.shape[0],
        _ptr(table), table.shape[0], table.stride(0), _ptr(a.rows), _ptr(a.lens),
        h, hkv, d, _ptr(out), dtype_code(out), 0,  # slot 18: threads, given to the run
        _ptr(qkv, h * d), qkv.stride(0), _ptr(qkv, (h + hkv) * d), qkv.stride(0), _ptr(a.loc), int(k.amx),
        new_code,
    )  # fmt: skip
    return Op(DECODE_ATTN, address(k._fn), args, a.scale)


class DecodePlanError(RuntimeError):
    """A kernel of the plan refused its call (the op's kind and the kernel's return code)."""


class DecodePlan:
    """Ops run in order by one C call; holds the tensors they point at."""

    def __init__(self, lib: ctypes.CDLL, ops: list[Op], keep: list[torch.Tensor]) -> None:
        self._run = lib.meshlm_decode_plan_run
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        self._run.restype = ctypes.c_int64
        self._run_timed = lib.meshlm_decode_plan_run_timed
        self._run_timed.argtypes = [*self._run.argtypes, ctypes.c_void_p]
        self._run_timed.restype = ctypes.c_int64
        size = lib.meshlm_decode_plan_op_size
        size.restype = ctypes.c_int64
        if size() != ctypes.sizeof(_COp):
            raise RuntimeError(f"decode plan op is {size()} bytes in C, {ctypes.sizeof(_COp)} here")
        self.ops = ops
        self._keep = keep
        self._array = (_COp * len(ops))()
        for c, op in zip(self._array, ops):
            if len(op.args) > OP_ARGS:
                raise ValueError(f"{KIND_NAMES[op.kind]} op has {len(op.args)} args (at most {OP_ARGS})")
            c.kind, c.min_rows, c.max_rows, c.fn, c.f = op.kind, op.min_rows, min(op.max_rows, 2**31 - 1), op.fn, op.f
            for i, v in enumerate(op.args):
                c.a[i] = v

    def run(self, rows: int, op_seconds: torch.Tensor | None = None) -> None:
        """Every op that takes batches of `rows` rows, in order. With op_seconds (float64
        [len(ops)], contiguous, on the CPU) each op's wall time is added to its slot: a profile."""
        array, n, threads = ctypes.addressof(self._array), len(self.ops), torch.get_num_threads()
        if op_seconds is None:
            rc = int(self._run(array, n, rows, threads))
        else:
            if op_seconds.dtype != torch.float64 or op_seconds.shape != (n,) or not op_seconds.is_contiguous():
                raise ValueError(f"op_seconds must be a contiguous float64 tensor of shape ({n},)")
            rc = int(self._run_timed(array, n, rows, threads, op_seconds.data_ptr()))
        if rc:
            i, code = rc // 256 - 1, rc % 256
            raise DecodePlanError(f"decode plan op {i} ({KIND_NAMES[self.ops[i].kind]}) failed with code {code}")


@functools.lru_cache(maxsize=1)
def load_decode_plan_library() -> ctypes.CDLL:
    """The replay library for this machine, built on first use; raises KernelUnavailable."""
    return load_library(SOURCE)
