"""RadixAttention: the attention layer a model calls; the math lives in the backend."""

from __future__ import annotations

import torch
from torch import nn

from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    """Per-layer attention descriptor. q: [T, num_heads*head_dim], k/v: [T, num_kv_heads*head_dim]."""

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        assert fb.attn_backend is not None, "ForwardBatch has no attention backend"
        return fb.attn_backend.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self,
            fb,
        ).reshape(-1, self.num_heads * self.head_dim)
