"""Triton attention backend (CUDA): paged decode and extend kernels reading the KV pool in place.

DECODE runs the split-KV kernel (triton_ops/decode_attention.py). Its fp32 scratch
(mid_o [B, Hq, S, D], mid_lse [B, Hq, S]) comes from buffers reserved once by
reserve_decode_buffers(max_bs): a decode batch of B <= max_bs uses views of their first B rows,
so the same storage is read and written at CUDA-graph capture and replay. The metadata holds
fb.req_pool_indices and fb.seq_lens themselves (not copies) when they already suit the kernel,
so a graph replay that refills those tensors is seen by the captured launches. Decode forward
neither allocates scratch nor syncs with the host.

EXTEND (and EMBED with a KV cache) runs triton_ops/extend_attention.py over the pool, prefix and
new tokens alike, after this forward's k/v are stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.attention.base import AttentionBackend
from meshlm.scheduler.attention.triton_ops.decode_attention import decode_attention_fwd
from meshlm.scheduler.attention.triton_ops.extend_attention import extend_attention_fwd

if TYPE_CHECKING:
    from meshlm.scheduler.layers.radix_attention import RadixAttention
    from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class TritonDecodeMeta:
    req_pool_indices: torch.Tensor  # [B] int32/int64 on the device
    seq_lens: torch.Tensor  # [B] int32/int64 on the device, counting the new token
    mid_o: torch.Tensor  # [B, Hq, S, D] fp32 scratch
    mid_lse: torch.Tensor  # [B, Hq, S] fp32 scratch


@dataclass
class TritonExtendMeta:
    req_pool_indices: torch.Tensor  # [N] on the device
    prefix_lens: torch.Tensor  # [N] int64: cached tokens before each request's new rows
    extend_seq_lens: torch.Tensor  # [N] int64: new rows of each request
    extend_start_loc: torch.Tensor  # [N] int64: first packed row of each request
    max_extend_len: int


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` itself when it is an integer tensor on `device` the kernels accept, else a copy."""
    if t.device == device and t.dtype in _INDEX_DTYPES:
        return t
    return t.to(device=device, dtype=torch.int64)


class TritonAttnBackend(AttentionBackend):
    """Paged attention with Triton kernels; see the module docstring for the buffer contract."""

    supports_cuda_graph = True

    def __init__(self, num_q_heads: int, head_dim: int, device: torch.device, num_kv_splits: int = 8) -> None:
        if num_kv_splits <= 0:
            raise ValueError(f"num_kv_splits must be positive, got {num_kv_splits}")
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.num_kv_splits = num_kv_splits
        self._mid_o: torch.Tensor | None = None
        self._mid_lse: torch.Tensor | None = None

    def reserve_decode_buffers(self, max_bs: int) -> None:
        """Allocate the decode scratch for batches of up to max_bs requests, once."""
        self._mid_o = torch.empty(
            (max_bs, self.num_q_heads, self.num_kv_splits, self.head_dim), dtype=torch.float32, device=self.device
        )
        self._mid_lse = torch.empty(
            (max_bs, self.num_q_heads, self.num_kv_splits), dtype=torch.float32, device=self.device
        )

    def _decode_scratch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the reserved scratch when it is large enough, else fresh tensors."""
        if self._mid_o is not None and self._mid_lse is not None and batch <= self._mid_o.shape[0]:
            return self._mid_o[:batch], self._mid_lse[:batch]
        mid_o = torch.empty(
            (batch, self.num_q_heads, self.num_kv_splits, self.head_dim), dtype=torch.float32, device=self.device
        )
        mid_lse = torch.empty((batch, self.num_q_heads, self.num_kv_splits), dtype=torch.float32, device=self.device)
        return mid_o, mid_lse

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            mid_o, mid_lse = self._decode_scratch(fb.batch_size)
            fb.attn_metadata = TritonDecodeMeta(
                _on_device(fb.req_pool_indices, self.device), _on_device(fb.seq_lens, self.device), mid_o, mid_lse
            )
            return
        prefix = list(fb.extend_prefix_lens_cpu) or [0] * len(fb.extend_seq_lens_cpu)
        starts = [0]
        for n in fb.extend_seq_lens_cpu[:-1]:
            starts.append(starts[-1] + n)
        # One host-to-device copy for the three per-request vectors.
        packed = torch.tensor([prefix, list(fb.extend_seq_lens_cpu), starts], dtype=torch.int64).to(self.device)
        fb.attn_metadata = TritonExtendMeta(
            _on_device(fb.req_pool_indices, self.device),
            packed[0],
            packed[1],
            packed[2],
            max(fb.extend_seq_lens_cpu, default=0),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        assert pool is not None and fb.out_cache_loc is not None and fb.req_to_token_pool is not None
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        req_to_token = fb.req_to_token_pool.req_to_token
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        meta = fb.attn_metadata
        if isinstance(meta, TritonDecodeMeta):
            decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                req_to_token,
                meta.req_pool_indices,
                meta.seq_lens,
                meta.mid_o,
                meta.mid_lse,
                layer.scaling,
                self.num_kv_splits,
            )
            return out
        assert isinstance(meta, TritonExtendMeta), "init_forward_metadata was not called for this batch"
        extend_attention_fwd(
            q,
            k_buf,
            v_buf,
            out,
            req_to_token,
            meta.req_pool_indices,
            meta.prefix_lens,
            meta.extend_seq_lens,
            meta.extend_start_loc,
            meta.max_extend_len,
            layer.scaling,
        )
        return out


def triton_unusable(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on `device` (None when a tiny decode launch works and gives
    the right answer). Triton compiles on first use and needs a C compiler for its launcher, so
    an importable triton is not enough; auto checks this once at start-up."""
    try:
        dev = torch.device(device)
        q = torch.ones((1, 1, 16), dtype=torch.float32, device=dev)
        k = torch.ones((2, 1, 16), dtype=torch.float32, device=dev)
        v = torch.arange(32, dtype=torch.float32, device=dev).view(2, 1, 16)
        table = torch.tensor([[0, 1]], dtype=torch.int64, device=dev)
        idx = torch.zeros(1, dtype=torch.int64, device=dev)
        lens = torch.full((1,), 2, dtype=torch.int64, device=dev)
        out = torch.empty_like(q)
        mid_o = torch.empty((1, 1, 2, 16), dtype=torch.float32, device=dev)
        mid_lse = torch.empty((1, 1, 2), dtype=torch.float32, device=dev)
        decode_attention_fwd(q, k, v, out, table, idx, lens, mid_o, mid_lse, 0.25, 2)
        want = v.mean(0)  # equal scores: the mean of the two values
        if not torch.allclose(out[0], want, atol=1e-4):
            return f"self-check gave {out[0, 0, :4].tolist()}..., expected {want[0, :4].tolist()}..."
    except Exception as e:  # noqa: BLE001 (any failure means: use another backend)
        return f"{type(e).__name__}: {e}"
    return None
