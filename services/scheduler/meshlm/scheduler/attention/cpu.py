"""The CPU attention backend: decode and extend through our C kernels, over the pool in place.

Decode is where a CPU server spends its attention time: every step each request reads its
whole cached K and V. The torch path gathers those rows into a padded copy and runs SDPA over
it (read, write, read again); the decode kernel (cpu_kernel.py, csrc/decode_attention.c) reads
them in place through req_to_token, once. In an extend batch (the batch's new K/V are stored
before anything is read), a segment of at most KERNEL_EXTEND_MAX tokens (above all the
one-token segments a mixed chunk adds for the running requests' decode step) goes through the
same kernel: its query token a, at absolute position prefix + a, is a decode query over the
first prefix + a + 1 slots of its request's row. Longer segments go through the extend kernel
(extend_kernel.py, csrc/extend_attention.c: causal flash attention with GEMM-shaped tiles, all
the segments of the batch in one call), or torch's SDPA where this build has no such kernel.
On a CPU with native bf16 a bf16 pool's long segments go through the tile extend kernel instead
(csrc/extend_attention_amx.c: the same flash attention on bf16 tiles: AMX's where the CPU has
them, else the same tile program in software, each tile product as VDPBF16PS on AVX512-BF16).
A pool whose dtype the kernels do not read (fp8) falls back to torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.attention.cpu_kernel import SUPPORTED_KV_DTYPES, DecodeKernel, storable
from meshlm.scheduler.attention.extend_kernel import AmxExtendKernel, ExtendKernel, ExtendSegments
from meshlm.scheduler.attention.torch_native import ExtendMeta, TorchNativeAttnBackend, extend_meta
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from meshlm.scheduler.layers.radix_attention import RadixAttention
    from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


# Extend segments of up to this many tokens attend through the decode kernel (one pass over
# the prefix per token); longer ones through the extend kernel (one pass per block of queries,
# GEMM-shaped).
KERNEL_EXTEND_MAX = 8


@dataclass
class _FusedDecodeMeta:
    req_to_token: torch.Tensor  # [rows, max_context] int64, the pool's table itself
    rows: torch.Tensor  # [B] int64 rows of req_to_token
    lens: torch.Tensor  # [B] int64 visible tokens of each request, the new one included


@dataclass
class _SplitExtendMeta:
    """An extend batch split between the decode kernel (short segments) and the extend kernel
    or SDPA (long ones)."""

    kernel_tokens: torch.Tensor | None  # [n] int64 batch rows attended by the decode kernel; None = all, in order
    kernel: _FusedDecodeMeta | None  # per such token: its request's table row and visible length; None = none
    long_segments: list[int]  # indices of fb's requests with longer segments
    long: ExtendSegments | None  # those, in the extend kernel's terms (None when there are none)
    sdpa: ExtendMeta | None = None  # those, in SDPA's terms: built at the first layer that needs them


def split_extend(fb: ForwardBatch) -> _SplitExtendMeta:
    """The split of fb's extend segments by length."""
    assert fb.req_to_token_pool is not None
    rows = fb.req_pool_indices.tolist()
    tokens: list[int] = []
    tok_rows: list[int] = []
    tok_lens: list[int] = []
    long_segments: list[int] = []
    long_starts: list[int] = []
    start = 0
    for i, (pre, n) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        if n <= KERNEL_EXTEND_MAX:
            tokens.extend(range(start, start + n))
            tok_rows.extend([rows[i]] * n)
            tok_lens.extend(range(pre + 1, pre + n + 1))  # token a sees prefix + a + 1 slots
        else:
            long_segments.append(i)
            long_starts.append(start)
        start += n
    kernel = None
    if tokens:
        kernel = _FusedDecodeMeta(
            fb.req_to_token_pool.req_to_token,
            torch.tensor(tok_rows, dtype=torch.int64),
            torch.tensor(tok_lens, dtype=torch.int64),
        )
    long = None
    if long_segments:
        long = ExtendSegments.of(
            [rows[i] for i in long_segments],
            [fb.extend_prefix_lens_cpu[i] for i in long_segments],
            long_starts,
            [fb.extend_seq_lens_cpu[i] for i in long_segments],
        )
    every = not long_segments  # then tokens == 0 .. T-1 in order
    return _SplitExtendMeta(None if every else torch.tensor(tokens, dtype=torch.int64), kernel, long_segments, long)


class CpuAttnBackend(TorchNativeAttnBackend):
    """`amx_extend`: the bf16 tile extend kernel, which takes a bf16 pool's long extend segments
    where given (on a CPU with AMX or AVX512-BF16; ahead of SDPA and the float32 kernel).
    `sdpa_kv_dtypes`: pool dtypes whose long extend segments go to torch's SDPA even where the
    extend kernel builds. The kernel computes in float32 FMAs; on a CPU with AMX, SDPA's flash
    attention multiplies bf16 tiles natively and is 2-2.8x faster on a bf16 pool
    (`python bench/bench_extend_attention.py --dtype bfloat16`, 2-core AMX Xeon), so create_backend
    names bfloat16 there. With AVX512-BF16 but no AMX (2-core AMD EPYC) SDPA was 1.5-3.7x slower
    than the kernel, so bf16 stays on the kernel there."""

    def __init__(
        self,
        kernel: DecodeKernel,
        extend_kernel: ExtendKernel | None,
        sdpa_kv_dtypes: tuple[torch.dtype, ...] = (),
        amx_extend: AmxExtendKernel | None = None,
    ) -> None:
        self.kernel = kernel
        self.extend_kernel = extend_kernel
        self.sdpa_kv_dtypes = sdpa_kv_dtypes
        self.amx_extend = amx_extend

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pool = fb.token_to_kv_pool
        kernel_ok = pool is not None and pool.dtype in SUPPORTED_KV_DTYPES and fb.out_cache_loc is not None
        if kernel_ok and fb.forward_mode is ForwardMode.EXTEND:
            fb.attn_metadata = split_extend(fb)
            return None
        if not (kernel_ok and fb.forward_mode.is_decode()):
            return super().init_forward_metadata(fb)
        assert fb.req_to_token_pool is not None
        fb.attn_metadata = _FusedDecodeMeta(
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices.to(torch.int64).contiguous(),
            fb.seq_lens.to(torch.int64).contiguous(),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        """Decode: one kernel call stores the new K/V and attends (no separate index_put).
        Split extend: the batch's K/V stored, the short segments' tokens through the decode
        kernel, the long segments through the extend kernel (or SDPA)."""
        meta, pool = fb.attn_metadata, fb.token_to_kv_pool
        if isinstance(meta, _SplitExtendMeta) and pool is not None and fb.out_cache_loc is not None:
            return self._split_extend(q, k, v, layer, fb, meta)
        if (
            not isinstance(meta, _FusedDecodeMeta)
            or pool is None
            or fb.out_cache_loc is None
            or not storable(k.dtype, pool.dtype)
        ):
            return super().forward(q, k, v, layer, fb)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        out_dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = self.kernel(
            q,
            k_buf,
            v_buf,
            meta.req_to_token,
            meta.rows,
            meta.lens,
            layer.scaling,
            new_kv=(k, v, fb.out_cache_loc),
            out_dtype=out_dtype,
        )
        return out.to(q.dtype)

    def _split_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
        meta: _SplitExtendMeta,
    ) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        assert pool is not None and fb.out_cache_loc is not None
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        km = meta.kernel
        h, d = q.shape[1], q.shape[2]
        ext, amx = self.extend_kernel, self.amx_extend
        use_amx = (
            meta.long is not None
            and amx is not None
            and k_buf.dtype == torch.bfloat16
            and amx.supports(h, layer.num_kv_heads, d)
        )
        # bf16 on AMX: the new K/V stored in one C pass and the kernel's output written in bf16
        # (set_kv_buffer's index_put and a float32 output converted after cost ~40% of the
        # kernel's time on a 2048-token chunk of SmolLM2)
        bf16_amx = use_amx and q.dtype == k.dtype == v.dtype == k_buf.dtype
        if bf16_amx:
            assert amx is not None
            hkv = layer.num_kv_heads
            amx.store(k_buf, v_buf, k.view(-1, hkv, d), v.view(-1, hkv, d), fb.out_cache_loc)
        else:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        if km is not None and meta.kernel_tokens is None:
            return self.kernel(q, k_buf, v_buf, km.req_to_token, km.rows, km.lens, layer.scaling).to(q.dtype)
        use_kernel = use_amx or (
            meta.long is not None
            and ext is not None
            and k_buf.dtype not in self.sdpa_kv_dtypes
            and ext.supports(h, layer.num_kv_heads, d)
        )
        out = torch.empty(q.shape, dtype=torch.float32 if use_kernel and not bf16_amx else q.dtype)
        if km is not None:
            assert meta.kernel_tokens is not None
            part = self.kernel(
                q.index_select(0, meta.kernel_tokens), k_buf, v_buf, km.req_to_token, km.rows, km.lens, layer.scaling
            )
            out.index_copy_(0, meta.kernel_tokens, part.to(out.dtype))
        if meta.long is None:
            return out
        if use_kernel:
            kernel = amx if use_amx else ext
            assert kernel is not None and fb.req_to_token_pool is not None
            table = fb.req_to_token_pool.req_to_token
            return kernel(q, k_buf, v_buf, table, meta.long, layer.scaling, out).to(q.dtype)
        if meta.sdpa is None:
            meta.sdpa = extend_meta(fb, meta.long_segments)
        return self.extend(q, k, v, k_buf, v_buf, layer, meta.sdpa, out)

    def decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        meta = fb.attn_metadata
        if not isinstance(meta, _FusedDecodeMeta):
            return super().decode(q, k_buf, v_buf, layer, fb)
        out = self.kernel(q, k_buf, v_buf, meta.req_to_token, meta.rows, meta.lens, layer.scaling)
        return out.to(q.dtype)
