"""The CPU attention backend: decode through the fused C kernel, extend as torch_native.

Decode is where a CPU server spends its attention time: every step each request reads its
whole cached K and V. The torch path gathers those rows into a padded copy and runs SDPA over
it (read, write, read again); the kernel (cpu_kernel.py, csrc/decode_attention.c) reads them
in place through req_to_token, once. Extend keeps torch's SDPA, which is a GEMM there.
A pool whose dtype the kernel does not read (fp8) falls back to the torch decode path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.attention.cpu_kernel import SUPPORTED_KV_DTYPES, DecodeKernel
from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend

if TYPE_CHECKING:
    from meshlm.scheduler.layers.radix_attention import RadixAttention
    from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _FusedDecodeMeta:
    req_to_token: torch.Tensor  # [rows, max_context] int64, the pool's table itself
    rows: torch.Tensor  # [B] int64 rows of req_to_token
    lens: torch.Tensor  # [B] int64 visible tokens of each request, the new one included


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, kernel: DecodeKernel) -> None:
        self.kernel = kernel

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pool = fb.token_to_kv_pool
        fused = fb.forward_mode.is_decode() and pool is not None and pool.dtype in SUPPORTED_KV_DTYPES
        if not fused:
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
        """Decode: one kernel call stores the new K/V and attends (no separate index_put)."""
        meta, pool = fb.attn_metadata, fb.token_to_kv_pool
        if not isinstance(meta, _FusedDecodeMeta) or pool is None or k.dtype != pool.dtype or fb.out_cache_loc is None:
            return super().forward(q, k, v, layer, fb)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        out = self.kernel(
            q, k_buf, v_buf, meta.req_to_token, meta.rows, meta.lens, layer.scaling, new_kv=(k, v, fb.out_cache_loc)
        )
        return out.to(q.dtype)

    def decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        meta = fb.attn_metadata
        if not isinstance(meta, _FusedDecodeMeta):
            return super().decode(q, k_buf, v_buf, layer, fb)
        out = self.kernel(q, k_buf, v_buf, meta.req_to_token, meta.rows, meta.lens, layer.scaling)
        return out.to(q.dtype)
