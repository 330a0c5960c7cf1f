"""The Triton paged-attention kernels and backend equal plain per-request attention.

Decode (split-KV) and extend kernels are checked against a gather + softmax reference over a pool
whose slots are scattered, with ragged lengths (1, shorter than the number of splits, not a
multiple of it), GQA groups 1/3/4, a non-power-of-two head dim and float32/bfloat16. Decode is
also checked the way a CUDA graph uses it: scratch larger than the batch, and a second launch
on the same tensors after their values changed. The backend matches TorchNativeAttnBackend
through forward(), storing the new k/v at out_cache_loc first.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported), with small blocks to stay fast.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")


def _patch_interpreter() -> None:
    """Work around two quirks of Triton 3.6's interpreter (no effect on compiled kernels):

    * a scalar becomes a Python int through int(ndarray of shape (1,)), which NumPy >= 2.4
      rejects, so a loop whose bounds are loaded values (range(start, end)) fails: convert
      through .item() instead;
    * tl.dot multiplies bfloat16 operands as their raw uint16 storage: widen them to float32
      first (exact; the products are accumulated in float32 anyway).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original_patch = interpreter._patch_lang_tensor

    def patch(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch

    original_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype.scalar != triton.language.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), triton.language.float32)

    def create_dot(
        self: object, a: interpreter.TensorHandle, b: interpreter.TensorHandle, *args: object
    ) -> interpreter.TensorHandle:
        return original_dot(self, widen(a), widen(b), *args)

    interpreter.InterpreterBuilder.create_dot = create_dot


_patch_interpreter()

from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from meshlm.scheduler.attention.triton_backend import (  # noqa: E402
    TritonAttnBackend,
    TritonDecodeMeta,
    TritonExtendMeta,
)
from meshlm.scheduler.attention.triton_ops.decode_attention import decode_attention_fwd  # noqa: E402
from meshlm.scheduler.attention.triton_ops.extend_attention import extend_attention_fwd  # noqa: E402
from meshlm.scheduler.layers.radix_attention import RadixAttention  # noqa: E402
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# tl.dot needs every dim >= 16 on a GPU; the interpreter takes smaller blocks (more loop trips).
BLOCK = 16 if DEVICE.type == "cuda" else 8


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


class _Paged:
    """A random pool [slots, Hkv, D] and a slot table whose row i + 1 holds request i's
    positions 0 .. lens[i] - 1 at scattered slots (slot 0, the padding slot, is never used)."""

    def __init__(self, lens: list[int], kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        slots = sum(lens) + 64
        self.k = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
        self.v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
        self.table = torch.zeros(len(lens) + 2, max(lens) + 3, dtype=torch.int64)
        picked = rng.sample(range(1, slots), sum(lens))
        start = 0
        for i, n in enumerate(lens):
            self.table[i + 1, :n] = torch.tensor(picked[start : start + n])
            start += n
        self.table = self.table.to(DEVICE)
        self.rows = torch.arange(1, len(lens) + 1, device=DEVICE)

    def attend(self, i: int, q: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
        """Reference attention of request i's queries q [n, Hq, D] at absolute positions
        first_pos .. first_pos + n - 1, each seeing positions <= its own; fp32 [n, Hq, D]."""
        n, heads = q.shape[0], q.shape[1]
        group = heads // self.k.shape[1]
        idx = self.table[i + 1, : first_pos + n]
        keys = self.k[idx].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vals = self.v[idx].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,lhd->hml", q.float(), keys) * scale
        visible = torch.arange(first_pos + n, device=q.device)[None, :] <= (
            first_pos + torch.arange(n, device=q.device)[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hml,lhd->mhd", scores.softmax(-1), vals)


def _decode(
    paged: _Paged,
    q: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    splits: int,
) -> torch.Tensor:
    out = torch.empty_like(q)
    decode_attention_fwd(
        q,
        paged.k,
        paged.v,
        out,
        paged.table,
        paged.rows[: q.shape[0]],
        seq_lens,
        mid_o,
        mid_lse,
        q.shape[-1] ** -0.5,
        splits,
        block_n=BLOCK,
    )
    return out


def _check_decode(paged: _Paged, q: torch.Tensor, out: torch.Tensor, lens: list[int]) -> None:
    for i, n in enumerate(lens):
        ref = paged.attend(i, q[i : i + 1], n - 1, q.shape[-1] ** -0.5)[0]
        err = (out[i].float() - ref).abs().max().item()
        assert err <= _tol(q.dtype), (i, n, err)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,dtype",
    [
        (4, 4, 16, torch.float32),
        (6, 2, 32, torch.float32),
        (8, 2, 24, torch.float32),
        (9, 3, 64, torch.float32),
        (9, 3, 64, torch.bfloat16),
        (8, 2, 16, torch.bfloat16),
    ],
)
def test_decode_kernel_matches_reference(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    lens = [1, 5, 8, 37, 3, 17]  # 1, < splits, == splits, not a multiple of splits
    splits = 8
    paged = _Paged(lens, kv_heads, dim, dtype)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    mid_o = torch.empty(len(lens), heads, splits, dim, device=DEVICE)
    mid_lse = torch.empty(len(lens), heads, splits, device=DEVICE)
    out = _decode(paged, q, torch.tensor(lens, device=DEVICE), mid_o, mid_lse, splits)
    assert out.dtype == dtype
    _check_decode(paged, q, out, lens)


def test_decode_few_splits_loops_over_blocks() -> None:
    """Two splits over lengths up to 40: each split spans several BLOCK_N blocks."""
    lens = [40, 2, 33]
    paged = _Paged(lens, 2, 16, torch.float32, seed=3)
    q = torch.randn(len(lens), 8, 16, device=DEVICE)
    out = _decode(
        paged,
        q,
        torch.tensor(lens, device=DEVICE),
        torch.empty(3, 8, 2, 16, device=DEVICE),
        torch.empty(3, 8, 2, device=DEVICE),
        2,
    )
    _check_decode(paged, q, out, lens)


def test_decode_graph_style_reuse() -> None:
    """Scratch with more rows than the batch leaves the extra rows alone; relaunching on the same
    index tensors after their values changed (a graph replay) gives the new results; a padded
    row with seq_len 0 yields zeros, not NaN."""
    heads, kv_heads, dim, splits = 6, 2, 16, 4
    lens = [30, 7, 1, 12]
    paged = _Paged([40, 40, 40, 40], kv_heads, dim, torch.float32, seed=5)
    mid_o = torch.full((7, heads, splits, dim), float("nan"), device=DEVICE)
    mid_lse = torch.full((7, heads, splits), float("nan"), device=DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    q = torch.randn(4, heads, dim, device=DEVICE)
    out = _decode(paged, q, seq_lens, mid_o[:4], mid_lse[:4], splits)
    _check_decode(paged, q, out, lens)
    assert torch.isnan(mid_o[4:]).all() and torch.isnan(mid_lse[4:]).all()

    new_lens = [3, 40, 9, 25]
    seq_lens.copy_(torch.tensor(new_lens, device=DEVICE))
    q.copy_(torch.randn(4, heads, dim, device=DEVICE))
    out = _decode(paged, q, seq_lens, mid_o[:4], mid_lse[:4], splits)
    _check_decode(paged, q, out, new_lens)

    seq_lens[2] = 0
    out = _decode(paged, q, seq_lens, mid_o[:4], mid_lse[:4], splits)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for i in (0, 1, 3):
        ref = paged.attend(i, q[i : i + 1], new_lens[i] - 1, dim**-0.5)[0]
        assert (out[i] - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "heads,kv_heads,dim,dtype",
    [
        (4, 4, 16, torch.float32),
        (6, 2, 24, torch.float32),
        (8, 2, 32, torch.float32),
        (9, 3, 64, torch.float32),
        (6, 2, 32, torch.bfloat16),
    ],
)
def test_extend_kernel_matches_reference(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    prefixes = [0, 7, 0, 13, 2]
    extends = [1, 20, 37, 5, 1]  # 1 and > BLOCK_M
    lens = [p + e for p, e in zip(prefixes, extends)]
    paged = _Paged(lens, kv_heads, dim, dtype, seed=2)
    total = sum(extends)
    q = torch.randn(total, heads, dim, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    starts = [sum(extends[:i]) for i in range(len(extends))]
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q,
        paged.k,
        paged.v,
        out,
        paged.table,
        paged.rows.to(torch.int32),
        torch.tensor(prefixes, device=DEVICE, dtype=torch.int32),
        torch.tensor(extends, device=DEVICE),
        torch.tensor(starts, device=DEVICE),
        max(extends),
        dim**-0.5,
        block_m=2 * BLOCK,
        block_n=BLOCK,
    )
    assert out.dtype == dtype
    for i, (pre, n, s) in enumerate(zip(prefixes, extends, starts)):
        ref = paged.attend(i, q[s : s + n], pre, dim**-0.5)
        err = (out[s : s + n].float() - ref).abs().max().item()
        assert err <= _tol(dtype), (i, err)


def _forward_batch(
    mode: ForwardMode,
    prefixes: list[int],
    extends: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
) -> tuple[ForwardBatch, RadixAttention, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose prefix KV is already in a fresh pool (scattered slots); returns it with a
    layer and the packed q, k, v of its new tokens (views into one qkv tensor, as the model
    hands them over)."""
    torch.manual_seed(7)
    rng = random.Random(7)
    lens = [p + e for p, e in zip(prefixes, extends)]
    size = sum(lens) + 32
    pool = MHATokenToKVPool(size, 1, dtype, kv_heads, dim, 1, device=DEVICE)
    rows = ReqToTokenPool(len(lens), max(lens) + 1, device=DEVICE)
    picked = rng.sample(range(1, size + 1), sum(lens))
    locs: list[int] = []
    start = 0
    for i, (pre, n) in enumerate(zip(prefixes, lens)):
        rows.req_to_token[i + 1, :n] = torch.tensor(picked[start : start + n], device=DEVICE)
        locs += picked[start + pre : start + n]
        start += n
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape).to(dtype))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape).to(dtype))
    total = sum(extends)
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(lens),
        input_ids=torch.zeros(total, dtype=torch.int64, device=DEVICE),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefixes, extends)]).to(DEVICE),
        seq_lens=torch.tensor(lens, device=DEVICE),
        req_pool_indices=torch.arange(1, len(lens) + 1, device=DEVICE),
        out_cache_loc=torch.tensor(locs, device=DEVICE),
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=list(prefixes),
        extend_seq_lens_cpu=list(extends),
        req_to_token_pool=rows,
        token_to_kv_pool=pool,
    )
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim).to(dtype).to(DEVICE)
    q, k, v = (t.view(total, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    return fb, RadixAttention(heads, dim, dim**-0.5, kv_heads, 0), q, k, v


def _run_both(
    fb: ForwardBatch,
    layer: RadixAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    triton_be: TritonAttnBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, torch_native output), each on its own copy of the pool."""
    pool = fb.token_to_kv_pool
    assert pool is not None and fb.out_cache_loc is not None
    before_k, before_v = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    triton_be.init_forward_metadata(fb)
    got = triton_be.forward(q, k, v, layer, fb)
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc], k) and torch.equal(pool.v_buffer[0][fb.out_cache_loc], v)
    pool.k_buffer[0].copy_(before_k)
    pool.v_buffer[0].copy_(before_v)
    native = TorchNativeAttnBackend()
    native.init_forward_metadata(fb)
    want = native.forward(q, k, v, layer, fb)
    return got, want


@pytest.mark.parametrize("heads,kv_heads,dim,dtype", [(6, 2, 16, torch.float32), (9, 3, 64, torch.bfloat16)])
def test_backend_extend_matches_torch_native(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    fb, layer, q, k, v = _forward_batch(ForwardMode.EXTEND, [0, 9, 4], [6, 3, 1], heads, kv_heads, dim, dtype)
    backend = TritonAttnBackend(heads, dim, DEVICE)
    backend.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert isinstance(meta, TritonExtendMeta) and meta.max_extend_len == 6
    assert meta.extend_start_loc.tolist() == [0, 6, 9] and meta.prefix_lens.tolist() == [0, 9, 4]
    got, want = _run_both(fb, layer, q, k, v, backend)
    assert got.shape == q.shape and got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() <= _tol(dtype)


@pytest.mark.parametrize("heads,kv_heads,dim,dtype", [(6, 2, 16, torch.float32), (9, 3, 64, torch.bfloat16)])
def test_backend_decode_matches_torch_native(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    lens = [1, 12, 30, 5]
    fb, layer, q, k, v = _forward_batch(
        ForwardMode.DECODE, [n - 1 for n in lens], [1] * len(lens), heads, kv_heads, dim, dtype
    )
    backend = TritonAttnBackend(heads, dim, DEVICE, num_kv_splits=4)
    backend.reserve_decode_buffers(6)
    backend.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert isinstance(meta, TritonDecodeMeta)
    # The batch's own index tensors (a graph's static buffers) and views of the reserved scratch.
    assert meta.seq_lens is fb.seq_lens and meta.req_pool_indices is fb.req_pool_indices
    assert backend._mid_o is not None and meta.mid_o.data_ptr() == backend._mid_o.data_ptr()
    got, want = _run_both(fb, layer, q, k, v, backend)
    assert got.shape == q.shape and got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() <= _tol(dtype)


def test_backend_decode_batch_beyond_reserved_gets_fresh_scratch() -> None:
    backend = TritonAttnBackend(4, 16, DEVICE, num_kv_splits=2)
    backend.reserve_decode_buffers(2)
    fb, layer, q, k, v = _forward_batch(ForwardMode.DECODE, [3, 0, 8], [1, 1, 1], 4, 2, 16, torch.float32)
    backend.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert isinstance(meta, TritonDecodeMeta) and meta.mid_o.shape[0] == 3
    got, want = _run_both(fb, layer, q, k, v, backend)
    assert (got - want).abs().max().item() <= 1e-5


def test_self_check_passes_where_the_kernels_run() -> None:
    from meshlm.scheduler.attention.triton_backend import triton_unusable

    assert triton_unusable(DEVICE) is None
