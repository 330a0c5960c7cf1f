"""Pooler for decoder models served as embedding models: last-token pooling, L2-normalised."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


class LastTokenPooler(nn.Module):
    def __init__(self, normalize: bool = True) -> None:
        super().__init__()
        self.normalize = normalize

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """hidden: [T, H] packed -> [B, H], the hidden state of each request's last token."""
        last = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        out = hidden[last.to(hidden.device)].float()
        return F.normalize(out, p=2, dim=-1) if self.normalize else out
