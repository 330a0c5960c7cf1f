"""The attention backend interface: how RadixAttention's math is done over the paged KV pool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshlm.scheduler.layers.radix_attention import RadixAttention
    from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Contract: forward() first stores the new tokens' k/v at fb.out_cache_loc in the layer's
    pool buffers, then attends each query token to every cached token of its own request at
    positions <= its own (causal), reading KV through req_to_token. Returns [T, H, D].

    A backend with supports_cuda_graph = True is graph-safe for DECODE: its metadata refers to
    fb.seq_lens and fb.req_pool_indices as given (the graph runner's static buffers), reads no
    host-side lists, and after reserve_decode_buffers(max_bs) its decode forward allocates
    nothing and never syncs with the host, so a captured forward replays with new values."""

    supports_cuda_graph = False

    def reserve_decode_buffers(self, max_bs: int) -> None:  # noqa: B027 (optional hook)
        """Allocate the decode scratch for batches of up to max_bs rows once (graph capture)."""

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Precompute per-forward index tensors once; reused by every layer."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor: ...
