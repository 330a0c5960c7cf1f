"""LogitsProcessor: pick the hidden states whose logits are needed and project them.

EXTEND batches need the last position of every request (to sample the next token) and, for
requests that asked for input logprobs, the positions [start_i, extend_len_i - 1) of their
extend segment (position j predicts fill token j + 1). DECODE batches need every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.layers.cpu_gemm import PackedLinear, PackPlan, try_pack
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] float32
    # Rows for input logprobs, request after request; None when nobody asked for them.
    input_logits: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, tp: TpGroup = SINGLE, logit_scale: float = 1.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.logit_scale = logit_scale
        # The head in oneDNN's layout (CPU, set by prepack); the dense weight stays the
        # caller's (with tied embeddings it is also the embedding table).
        self.packed_head: PackedLinear | None = None

    def prepack(self, lm_head_weight: torch.Tensor, plan: PackPlan | None = None) -> bool:
        self.packed_head = try_pack(lm_head_weight, None, plan)
        return self.packed_head is not None

    def _project(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = self.packed_head(hidden) if self.packed_head is not None else torch.matmul(hidden, weight.t())
        logits = self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        return logits.float()

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, fb: ForwardBatch) -> LogitsProcessorOutput:
        if fb.forward_mode.is_decode():
            return LogitsProcessorOutput(self._project(hidden, lm_head_weight))
        lens = fb.extend_seq_lens_cpu
        ends = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        last = (ends - 1).to(hidden.device)
        if not fb.return_logprob or not any(s < n - 1 for s, n in zip(fb.extend_logprob_start_lens_cpu, lens)):
            return LogitsProcessorOutput(self._project(hidden[last], lm_head_weight))
        # Segment i of the packed batch starts at ends[i] - lens[i].
        rows: list[torch.Tensor] = []
        for i, (start, n) in enumerate(zip(fb.extend_logprob_start_lens_cpu, lens)):
            base = int(ends[i]) - n
            if start < n - 1:
                rows.append(torch.arange(base + start, base + n - 1))
        picked = torch.cat(rows).to(hidden.device)
        both = self._project(torch.cat([hidden[last], hidden[picked]]), lm_head_weight)
        b = len(lens)
        return LogitsProcessorOutput(both[:b], both[b:])
