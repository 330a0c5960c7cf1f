"""A torch-only attention backend (CPU and CUDA) over the paged KV pool.

EXTEND: one SDPA call per request. Query token a of request i (absolute position
prefix_i + a) may see cache positions 0 .. prefix_i + a, i.e. a causal mask aligned to the
bottom-right corner of the [extend_len, seq_len] score matrix. A request without a cached
prefix attends over its fresh k/v directly (no gather).

DECODE: one batched SDPA call per length bucket. Requests are sorted by length and cut into
buckets whose longest row is at most BUCKET_GROWTH x (+ BUCKET_SLACK) its shortest, so rows of
very different lengths are not all padded to the longest context of the batch (gathering and
attending over padding is most of a decode step's attention cost). Within a bucket, cache
positions are gathered into a padded [b, L_bucket] layout (index and gather buffers built once
per forward in init_forward_metadata); a key mask hides positions >= seq_len_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from meshlm.scheduler.attention.base import AttentionBackend

if TYPE_CHECKING:
    from meshlm.scheduler.layers.radix_attention import RadixAttention
    from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


BUCKET_GROWTH = 1.25
BUCKET_SLACK = 64


@dataclass
class _DecodeBucket:
    rows: torch.Tensor | None  # [b] batch rows of this bucket; None = the whole batch, in order
    flat_idx: torch.Tensor  # [b * L] KV slots, row-major, padded with slot 0
    key_mask: torch.Tensor  # [b, 1, 1, L] True where a key may be attended
    # Gather buffers reused by every layer of this forward (fresh tensors per layer cost
    # mostly page faults): [b * L, H_kv, D].
    k_gather: torch.Tensor
    v_gather: torch.Tensor


@dataclass
class _DecodeMeta:
    buckets: list[_DecodeBucket]


def length_buckets(lens: list[int]) -> list[list[int]]:
    """Batch rows grouped by length: ascending runs whose longest is at most
    max(shortest * BUCKET_GROWTH, shortest + BUCKET_SLACK). Every row is in exactly one bucket."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    buckets: list[list[int]] = []
    limit = -1.0
    for i in order:
        if not buckets or lens[i] > limit:
            buckets.append([])
            limit = max(lens[i] * BUCKET_GROWTH, lens[i] + BUCKET_SLACK)
        buckets[-1].append(i)
    return buckets


@dataclass
class ExtendMeta:
    kv_idx: list[torch.Tensor]  # per request, [seq_len_i] KV slots (only when prefix_i > 0)
    bounds: list[tuple[int, int]]  # per request, [start, end) rows of the packed batch
    prefix_lens: list[int]  # per request, cached tokens before its extend rows


def extend_meta(fb: ForwardBatch, segments: list[int] | None = None) -> ExtendMeta:
    """The extend metadata of `segments` (indices of fb's requests; None = all of them)."""
    assert fb.req_to_token_pool is not None
    table = fb.req_to_token_pool.req_to_token
    starts = [0]
    for n in fb.extend_seq_lens_cpu:
        starts.append(starts[-1] + n)
    rows = fb.req_pool_indices.tolist()
    meta = ExtendMeta([], [], [])
    for i in range(len(rows)) if segments is None else segments:
        pre = fb.extend_prefix_lens_cpu[i]
        meta.bounds.append((starts[i], starts[i + 1]))
        meta.prefix_lens.append(pre)
        meta.kv_idx.append(
            table[rows[i], : starts[i + 1] - starts[i] + pre] if pre > 0 else torch.empty(0, dtype=torch.int64)
        )
    return meta


class TorchNativeAttnBackend(AttentionBackend):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        assert fb.req_to_token_pool is not None
        table = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            pool = fb.token_to_kv_pool
            assert pool is not None
            k0 = pool.get_key_buffer(0)
            groups = length_buckets(fb.seq_lens_cpu)
            buckets = []
            for group in groups:
                rows = None if len(groups) == 1 else torch.tensor(group, dtype=torch.int64, device=k0.device)
                pool_rows = fb.req_pool_indices if rows is None else fb.req_pool_indices[rows]
                lens = fb.seq_lens if rows is None else fb.seq_lens[rows]
                max_len = max(fb.seq_lens_cpu[i] for i in group)
                kv_idx = table[pool_rows, :max_len]
                mask = torch.arange(max_len, device=kv_idx.device)[None, :] < lens.to(kv_idx.device)[:, None]
                shape = (kv_idx.numel(), k0.shape[1], k0.shape[2])
                buckets.append(
                    _DecodeBucket(
                        rows,
                        kv_idx.masked_fill(~mask, 0).reshape(-1),
                        mask[:, None, None, :],
                        torch.empty(shape, dtype=k0.dtype, device=k0.device),
                        torch.empty(shape, dtype=k0.dtype, device=k0.device),
                    )
                )
            fb.attn_metadata = _DecodeMeta(buckets)
            return
        fb.attn_metadata = extend_meta(fb)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        assert pool is not None and fb.out_cache_loc is not None
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if fb.forward_mode.is_decode():
            return self.decode(q, k_buf, v_buf, layer, fb)
        meta = fb.attn_metadata
        assert isinstance(meta, ExtendMeta)
        return self.extend(q, k, v, k_buf, v_buf, layer, meta, torch.empty_like(q))

    def decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        """Decode attention of q [B, H, D] over the pool buffers (this token's KV already stored)."""
        meta = fb.attn_metadata
        assert isinstance(meta, _DecodeMeta)
        if len(meta.buckets) == 1:
            return self._decode_bucket(q, k_buf, v_buf, layer, meta.buckets[0])
        out = torch.empty_like(q)
        for bucket in meta.buckets:
            assert bucket.rows is not None
            part = self._decode_bucket(q.index_select(0, bucket.rows), k_buf, v_buf, layer, bucket)
            out.index_copy_(0, bucket.rows, part)
        return out

    @staticmethod
    def _decode_bucket(
        q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention, bucket: _DecodeBucket
    ) -> torch.Tensor:
        b, h, d = q.shape
        hkv = layer.num_kv_heads
        torch.index_select(k_buf, 0, bucket.flat_idx, out=bucket.k_gather)
        torch.index_select(v_buf, 0, bucket.flat_idx, out=bucket.v_gather)
        keys = bucket.k_gather.view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)  # [b, Hkv, L, D]
        vals = bucket.v_gather.view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
        # GQA without expanding K/V: query head j uses KV head j // G, so the G query heads
        # of a KV head act as G query positions attending to the same keys.
        out = F.scaled_dot_product_attention(
            q.reshape(b, hkv, h // hkv, d), keys, vals, attn_mask=bucket.key_mask, scale=layer.scaling
        )
        return out.reshape(b, h, d)

    @staticmethod
    def extend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: RadixAttention,
        meta: ExtendMeta,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Rows of `out` of meta's requests = their causal attention (other rows untouched)."""
        gqa = layer.num_heads != layer.num_kv_heads
        for (s, e), pre, kv_idx in zip(meta.bounds, meta.prefix_lens, meta.kv_idx):
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if pre == 0:
                ki = k[s:e].transpose(0, 1).unsqueeze(0)
                vi = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=gqa)
            else:
                ki = k_buf[kv_idx].transpose(0, 1).unsqueeze(0).to(q.dtype)
                vi = v_buf[kv_idx].transpose(0, 1).unsqueeze(0).to(q.dtype)
                n, total = e - s, pre + (e - s)
                # Query a sits at absolute position pre + a and sees keys 0 .. pre + a.
                mask = torch.arange(total)[None, :] <= (torch.arange(n)[:, None] + pre)
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask.to(q.device), scale=layer.scaling, enable_gqa=gqa
                )
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out
