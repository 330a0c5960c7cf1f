"""SamplingBatchInfo: the sampling parameters of a batch, as tensors plus Python-side flags.

Row ``i`` of every per-row field belongs to ``reqs[i]`` of the batch it was built from; the
running batch keeps it in step with ``filter_batch`` (drop finished requests) and
``merge_batch`` (append a new prefill batch) instead of rebuilding it.

Invariants:

- Every per-row list and tensor has ``batch_size`` rows.
- ``top_ks_cpu[i]`` is in ``[1, vocab_size]`` (``TOP_K_ALL`` is stored as ``vocab_size``).
- ``is_greedy_cpu[i]`` iff ``top_ks_cpu[i] == 1``. The flags ``need_top_k``,
  ``need_top_p`` and ``need_min_p`` ignore greedy rows, whose token is the argmax anyway.
- Python-side lists (``*_cpu``) let the sampler choose its path without a device sync.
- ``grammars[i]`` is row i's grammar matcher (constrained decoding) or None; before each
  sampling step ``update_regex_vocab_mask`` fills the bitmask of the rows that have one, and
  ``apply_logits_bias`` sets their disallowed tokens to -inf (after penalties, so logprobs see
  the constrained distribution, as in SGLang).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshlm.scheduler.constrained.vocab_mask import allocate_vocab_mask, apply_vocab_mask
from meshlm.scheduler.sampling.penalties import BatchedPenalizer

__all__ = ["SamplingBatchInfo"]


class SamplingBatchInfo:
    """Per-batch sampling state: temperatures [B,1], top_ps [B], top_ks [B], min_ps [B]."""

    def __init__(
        self,
        *,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        top_ks: Sequence[int],
        min_ps: Sequence[float],
        seeds: Sequence[int | None],
        penalizer: BatchedPenalizer,
        vocab_size: int,
        device: torch.device | str,
        grammars: Sequence[Any] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.temperatures_cpu = [float(t) for t in temperatures]
        self.top_ps_cpu = [float(p) for p in top_ps]
        self.top_ks_cpu = [max(1, min(int(k), vocab_size)) for k in top_ks]
        self.min_ps_cpu = [float(m) for m in min_ps]
        self.seeds: list[int | None] = list(seeds)
        self.penalizer = penalizer
        self.grammars: list[Any] = list(grammars) if grammars is not None else [None] * len(self.temperatures_cpu)
        self.vocab_mask: torch.Tensor | None = None  # bitmask rows of vocab_mask_rows
        self.vocab_mask_rows: list[int] = []
        dev = self.device
        self.temperatures = torch.tensor(self.temperatures_cpu, dtype=torch.float32, device=dev)
        self.temperatures = self.temperatures.view(-1, 1)
        self.top_ps = torch.tensor(self.top_ps_cpu, dtype=torch.float32, device=dev)
        self.top_ks = torch.tensor(self.top_ks_cpu, dtype=torch.int64, device=dev)
        self.min_ps = torch.tensor(self.min_ps_cpu, dtype=torch.float32, device=dev)
        self._refresh_flags()

    @classmethod
    def from_reqs(cls, reqs: Sequence[Any], vocab_size: int, device: torch.device | str) -> SamplingBatchInfo:
        """Build from requests whose sampling_params have been normalized."""
        params = [r.sampling_params for r in reqs]
        return cls(
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            top_ks=[p.top_k for p in params],
            min_ps=[p.min_p for p in params],
            seeds=[p.sampling_seed for p in params],
            penalizer=BatchedPenalizer.from_reqs(reqs, vocab_size, device),
            vocab_size=vocab_size,
            device=device,
            grammars=[getattr(r, "grammar", None) for r in reqs],
        )

    def _refresh_flags(self) -> None:
        v = self.vocab_size
        self.batch_size = len(self.temperatures_cpu)
        self.is_greedy_cpu = [k == 1 for k in self.top_ks_cpu]
        sampled = [i for i, g in enumerate(self.is_greedy_cpu) if not g]
        self.is_all_greedy = not sampled
        self.need_top_k = any(self.top_ks_cpu[i] < v for i in sampled)
        self.need_top_p = any(self.top_ps_cpu[i] < 1.0 for i in sampled)
        self.need_min_p = any(self.min_ps_cpu[i] > 0.0 for i in sampled)
        self.all_temperatures_one = all(t == 1.0 for t in self.temperatures_cpu)
        self.has_seeds = any(s is not None for s in self.seeds)

    def __len__(self) -> int:
        return self.batch_size

    # ---- per step ----------------------------------------------------------------------
    def update_regex_vocab_mask(self) -> None:
        """Fill the token bitmask of every row whose grammar has not terminated (SGLang's
        name); rows without a grammar are not masked."""
        rows = [i for i, g in enumerate(self.grammars) if g is not None and not g.is_terminated()]
        self.vocab_mask_rows = rows
        if not rows:
            self.vocab_mask = None
            return
        mask = allocate_vocab_mask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            self.grammars[i].fill_vocab_mask(mask, j)
        self.vocab_mask = mask

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Apply penalties, logit_bias and the min_new_tokens mask to logits [B, V] in place,
        then the grammar bitmask of the last update_regex_vocab_mask (used once)."""
        self.penalizer.apply(logits)
        if self.vocab_mask is not None:
            apply_vocab_mask(logits, self.vocab_mask, self.vocab_mask_rows)
            self.vocab_mask, self.vocab_mask_rows = None, []

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record the token just sampled for every row (call once per decode step)."""
        self.penalizer.cumulate_output_tokens(next_token_ids)

    # ---- batch surgery -----------------------------------------------------------------
    def filter_batch(self, keep: Sequence[int]) -> None:
        """Keep only rows keep (distinct indices), in that order."""
        keep = list(keep)
        keep_t = torch.as_tensor(keep, dtype=torch.int64, device=self.device)
        self.temperatures_cpu = [self.temperatures_cpu[i] for i in keep]
        self.top_ps_cpu = [self.top_ps_cpu[i] for i in keep]
        self.top_ks_cpu = [self.top_ks_cpu[i] for i in keep]
        self.min_ps_cpu = [self.min_ps_cpu[i] for i in keep]
        self.seeds = [self.seeds[i] for i in keep]
        self.grammars = [self.grammars[i] for i in keep]
        self.temperatures = self.temperatures[keep_t]
        self.top_ps = self.top_ps[keep_t]
        self.top_ks = self.top_ks[keep_t]
        self.min_ps = self.min_ps[keep_t]
        self.penalizer.filter(keep)
        self._refresh_flags()

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append other's rows after this batch's rows (other is left unusable)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge batches with vocab sizes {self.vocab_size} and {other.vocab_size}")
        self.temperatures_cpu += other.temperatures_cpu
        self.top_ps_cpu += other.top_ps_cpu
        self.top_ks_cpu += other.top_ks_cpu
        self.min_ps_cpu += other.min_ps_cpu
        self.seeds += other.seeds
        self.grammars += other.grammars
        self.temperatures = torch.cat([self.temperatures, other.temperatures])
        self.top_ps = torch.cat([self.top_ps, other.top_ps])
        self.top_ks = torch.cat([self.top_ks, other.top_ks])
        self.min_ps = torch.cat([self.min_ps, other.min_ps])
        self.penalizer.merge(other.penalizer)
        self._refresh_flags()
