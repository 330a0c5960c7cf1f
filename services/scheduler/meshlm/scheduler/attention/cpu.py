"""The CPU attention backend: decode and short extend segments through the fused C kernel,
long extend segments as torch_native.

Decode is where a CPU server spends its attention time: every step each request reads its
whole cached K and V. The torch path gathers those rows into a padded copy and runs SDPA over
it (read, write, read again); the kernel (cpu_kernel.py, csrc/decode_attention.c) reads them
in place through req_to_token, once. In an extend batch, a segment of at most
KERNEL_EXTEND_MAX tokens (above all the one-token segments a mixed chunk adds for the running
requests' decode step) goes through the same kernel: its query token a, at absolute position
prefix + a, is a decode query over the first prefix + a + 1 slots of its request's row (the
batch's new K/V are stored before anything is read). Longer segments keep torch's SDPA, which
is a GEMM there. A pool whose dtype the kernel does not read (fp8) falls back to torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.attention.cpu_kernel import SUPPORTED_KV_DTYPES, DecodeKernel
from meshlm.scheduler.attention.torch_native import ExtendMeta, TorchNativeAttnBackend, extend_meta
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from meshlm.scheduler.layers.radix_attention import RadixAttention
    from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


# Extend segments of up to this many tokens attend through the decode kernel (one pass over
# the prefix per token); longer ones through SDPA (one pass per segment, GEMM-shaped).
KERNEL_EXTEND_MAX = 8


@dataclass
class _FusedDecodeMeta:
    req_to_token: torch.Tensor  # [rows, max_context] int64, the pool's table itself
    rows: torch.Tensor  # [B] int64 rows of req_to_token
    lens: torch.Tensor  # [B] int64 visible tokens of each request, the new one included


@dataclass
class _SplitExtendMeta:
    """An extend batch split between the kernel (short segments) and SDPA (long ones)."""

    kernel_tokens: torch.Tensor | None  # [n] int64 batch rows attended by the kernel; None = all, in order
    kernel: _FusedDecodeMeta  # per kernel token: its request's table row and visible length
    sdpa: ExtendMeta  # the long segments


def split_extend(fb: ForwardBatch) -> _SplitExtendMeta | None:
    """The split of fb's extend segments, or None when no segment is short enough."""
    assert fb.req_to_token_pool is not None
    rows = fb.req_pool_indices.tolist()
    tokens: list[int] = []
    tok_rows: list[int] = []
    tok_lens: list[int] = []
    long_segments: list[int] = []
    start = 0
    for i, (pre, n) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        if n <= KERNEL_EXTEND_MAX:
            tokens.extend(range(start, start + n))
            tok_rows.extend([rows[i]] * n)
            tok_lens.extend(range(pre + 1, pre + n + 1))  # token a sees prefix + a + 1 slots
        else:
            long_segments.append(i)
        start += n
    if not tokens:
        return None
    every = not long_segments  # then tokens == 0 .. T-1 in order
    return _SplitExtendMeta(
        None if every else torch.tensor(tokens, dtype=torch.int64),
        _FusedDecodeMeta(
            fb.req_to_token_pool.req_to_token,
            torch.tensor(tok_rows, dtype=torch.int64),
            torch.tensor(tok_lens, dtype=torch.int64),
        ),
        extend_meta(fb, long_segments),
    )


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, kernel: DecodeKernel) -> None:
        self.kernel = kernel

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pool = fb.token_to_kv_pool
        kernel_ok = pool is not None and pool.dtype in SUPPORTED_KV_DTYPES and fb.out_cache_loc is not None
        if kernel_ok and fb.forward_mode is ForwardMode.EXTEND:
            split = split_extend(fb)
            if split is None:
                return super().init_forward_metadata(fb)
            fb.attn_metadata = split
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
        Split extend: the batch's K/V stored, the short segments' tokens through the kernel,
        the long segments through SDPA."""
        meta, pool = fb.attn_metadata, fb.token_to_kv_pool
        if isinstance(meta, _SplitExtendMeta) and pool is not None and fb.out_cache_loc is not None:
            return self._split_extend(q, k, v, layer, fb, meta)
        if not isinstance(meta, _FusedDecodeMeta) or pool is None or k.dtype != pool.dtype or fb.out_cache_loc is None:
            return super().forward(q, k, v, layer, fb)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        out = self.kernel(
            q, k_buf, v_buf, meta.req_to_token, meta.rows, meta.lens, layer.scaling, new_kv=(k, v, fb.out_cache_loc)
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
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        km = meta.kernel
        if meta.kernel_tokens is None:
            return self.kernel(q, k_buf, v_buf, km.req_to_token, km.rows, km.lens, layer.scaling).to(q.dtype)
        out = torch.empty_like(q)
        part = self.kernel(
            q.index_select(0, meta.kernel_tokens), k_buf, v_buf, km.req_to_token, km.rows, km.lens, layer.scaling
        )
        out.index_copy_(0, meta.kernel_tokens, part.to(q.dtype))
        return self.extend(q, k, v, k_buf, v_buf, layer, meta.sdpa, out)

    def decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        meta = fb.attn_metadata
        if not isinstance(meta, _FusedDecodeMeta):
            return super().decode(q, k_buf, v_buf, layer, fb)
        out = self.kernel(q, k_buf, v_buf, meta.req_to_token, meta.rows, meta.lens, layer.scaling)
        return out.to(q.dtype)
