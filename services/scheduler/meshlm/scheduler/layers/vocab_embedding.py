"""Vocabulary-parallel embedding and LM head: rank r holds vocab rows [r*n, (r+1)*n)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.scheduler.distributed import SINGLE, TpGroup


def _padded(vocab: int, tp: TpGroup) -> int:
    """Vocab rounded up to a multiple of the TP size (padded rows are never selected)."""
    return (vocab + tp.size - 1) // tp.size * tp.size


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup where each rank owns a contiguous vocab slice; ids outside the slice
    contribute zeros and the all-reduce sums the one non-zero contribution."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TpGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.vocab_start, self.shard_size = tp.shard(_padded(num_embeddings, tp))
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=params_dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = max(0, min(self.shard_size, loaded.shape[0] - self.vocab_start))
        if loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding dim {loaded.shape[1]} != {param.shape[1]}")
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_start + rows].to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; LogitsProcessor computes hidden @ weight^T and gathers shards."""
