"""BatchedPenalizer: per-request logit adjustments for a batch of B requests over V tokens.

Semantics, applied by ``apply(logits)`` in place, in this order:

1. repetition_penalty ``p`` (HF/CTRL): for every token seen in the prompt or the output so
   far, ``logit > 0 -> logit / p`` and ``logit <= 0 -> logit * p``.
2. frequency_penalty ``f`` and presence_penalty ``r`` (OpenAI, output tokens only):
   ``logit -= f * count + r * (count > 0)`` where ``count`` is how often the token was
   generated so far.
3. logit_bias: ``logit[token] += bias``.
4. min_new_tokens: while ``len(output_ids) < min_new_tokens`` the request's stop token ids
   (a frozenset on the request: EOS unless ignore_eos, plus stop_token_ids) get ``-inf``.
   Applied last, so no bias can re-enable them.

Storage is sized by need: the dense ``[B, V]`` tensors (output counts for 2, a seen mask for
1) exist only when some row of the batch uses that penalty, and logit_bias / min_new_tokens
are kept as sparse (row, token) pairs. A batch without any of these costs one Python check.

Invariants:

- ``len(frequency) == len(presence) == len(repetition) == batch_size``.
- ``counts`` is None iff every row has zero frequency and presence penalty; otherwise it is
  ``[B, V]`` float32 and equals the output-token histogram on every row with a nonzero one
  (other rows are multiplied by zero and may hold zeros).
- ``seen`` is None iff every repetition penalty is 1; otherwise ``[B, V]`` bool marking
  prompt and output tokens on every row whose penalty is not 1.
- ``stop_left[j]`` is ``min_new_tokens - len(output_ids)`` of row ``stop_rows[j]``; pairs
  are dropped once every one of them is <= 0.
- The counts follow ``req.output_ids`` as they were at construction plus every token passed
  to ``cumulate_output_tokens``; call it exactly once per generated token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BatchedPenalizer"]


def _pairs_filter(
    rows: torch.Tensor, keep: torch.Tensor, batch_size: int, *others: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Keep the pairs whose row is in keep, renumbering rows to their position in keep."""
    remap = torch.full((batch_size,), -1, dtype=torch.int64, device=rows.device)
    remap[keep] = torch.arange(keep.numel(), dtype=torch.int64, device=rows.device)
    new_rows = remap[rows]
    sel = new_rows >= 0
    return (new_rows[sel],) + tuple(t[sel] for t in others)


class BatchedPenalizer:
    """Penalty state of a batch; see the module docstring for semantics and invariants."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.frequency: list[float] = []
        self.presence: list[float] = []
        self.repetition: list[float] = []
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        empty_i = torch.empty(0, dtype=torch.int64, device=self.device)
        self.bias_rows, self.bias_cols = empty_i, empty_i
        self.bias_vals = torch.empty(0, dtype=torch.float32, device=self.device)
        self.stop_rows, self.stop_cols, self.stop_left = empty_i, empty_i, empty_i
        self._max_stop_left = 0
        self._refresh()

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_reqs(cls, reqs: Sequence[Any], vocab_size: int, device: torch.device | str) -> BatchedPenalizer:
        """Build from requests (sampling_params, output_ids, origin_input_ids, stop_token_ids)."""
        pen = cls(vocab_size, device)
        dev = pen.device
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        stop_r: list[int] = []
        stop_c: list[int] = []
        stop_l: list[int] = []
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            pen.frequency.append(float(sp.frequency_penalty))
            pen.presence.append(float(sp.presence_penalty))
            pen.repetition.append(float(sp.repetition_penalty))
            for tok, val in sp.logit_bias_ids().items():
                if 0 <= tok < vocab_size:
                    bias_r.append(i)
                    bias_c.append(tok)
                    bias_v.append(val)
            left = int(sp.min_new_tokens) - len(req.output_ids)
            if left > 0:
                for tok in sorted(getattr(req, "stop_token_ids", ()) or ()):
                    if 0 <= tok < vocab_size:
                        stop_r.append(i)
                        stop_c.append(tok)
                        stop_l.append(left)
        b = len(reqs)
        if any(f != 0.0 for f in pen.frequency) or any(r != 0.0 for r in pen.presence):
            pen.counts = torch.zeros((b, vocab_size), dtype=torch.float32, device=dev)
            rows = [i for i in range(b) if pen.frequency[i] != 0.0 or pen.presence[i] != 0.0]
            pen._scatter_ids(pen.counts, rows, [reqs[i].output_ids for i in rows])
        if any(r != 1.0 for r in pen.repetition):
            pen.seen = torch.zeros((b, vocab_size), dtype=torch.bool, device=dev)
            rows = [i for i in range(b) if pen.repetition[i] != 1.0]
            ids = [list(reqs[i].origin_input_ids) + list(reqs[i].output_ids) for i in rows]
            pen._scatter_ids(pen.seen, rows, ids)
        if bias_r:
            pen.bias_rows = torch.tensor(bias_r, dtype=torch.int64, device=dev)
            pen.bias_cols = torch.tensor(bias_c, dtype=torch.int64, device=dev)
            pen.bias_vals = torch.tensor(bias_v, dtype=torch.float32, device=dev)
        if stop_r:
            pen.stop_rows = torch.tensor(stop_r, dtype=torch.int64, device=dev)
            pen.stop_cols = torch.tensor(stop_c, dtype=torch.int64, device=dev)
            pen.stop_left = torch.tensor(stop_l, dtype=torch.int64, device=dev)
            pen._max_stop_left = max(stop_l)
        pen._refresh()
        return pen

    def _scatter_ids(self, dst: torch.Tensor, rows: list[int], ids: list[list[int]]) -> None:
        """dst[row, id] += 1 (float) or = True (bool) for every id of every row."""
        if not rows:
            return
        r = torch.cat([torch.full((len(x),), i, dtype=torch.int64) for i, x in zip(rows, ids)])
        c = torch.cat([torch.as_tensor(list(x), dtype=torch.int64) for x in ids])
        ok = (c >= 0) & (c < self.vocab_size)
        r, c = r[ok].to(self.device), c[ok].to(self.device)
        if dst.dtype == torch.bool:
            dst[r, c] = True
        else:
            dst.index_put_((r, c), torch.ones_like(c, dtype=dst.dtype), accumulate=True)

    def _refresh(self) -> None:
        """Recompute flags and per-row penalty tensors from the Python lists."""
        self.batch_size = len(self.frequency)
        use_freq = any(f != 0.0 for f in self.frequency)
        use_pres = any(r != 0.0 for r in self.presence)
        use_rep = any(r != 1.0 for r in self.repetition)
        if not (use_freq or use_pres):
            self.counts = None
        if not use_rep:
            self.seen = None
        self._freq_t = self._column(self.frequency) if use_freq else None
        self._pres_t = self._column(self.presence) if use_pres else None
        self._rep_t = self._column(self.repetition) if use_rep else None
        self._drop_spent_stops()

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    def _drop_spent_stops(self) -> None:
        """Forget the min_new_tokens pairs once every row has reached its minimum."""
        if self._max_stop_left <= 0 and self.stop_rows.numel():
            empty = self.stop_rows[:0]
            self.stop_rows, self.stop_cols, self.stop_left = empty, empty, empty

    @property
    def is_active(self) -> bool:
        """Whether apply() changes anything for this batch."""
        return (
            self.counts is not None or self.seen is not None or self.bias_rows.numel() > 0 or self.stop_rows.numel() > 0
        )

    # ---- per step ----------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> None:
        """Adjust logits [B, V] in place (see the module docstring for the order)."""
        if not self.is_active:
            return
        if self.seen is not None and self._rep_t is not None:
            rep = self._rep_t
            scaled = torch.where(logits > 0, logits / rep, logits * rep)
            logits.copy_(torch.where(self.seen, scaled, logits))
        if self.counts is not None:
            if self._freq_t is not None:
                logits.addcmul_(self.counts, self._freq_t, value=-1.0)
            if self._pres_t is not None:
                logits.addcmul_(self.counts.clamp(max=1.0), self._pres_t, value=-1.0)
        if self.bias_rows.numel():
            logits.index_put_((self.bias_rows, self.bias_cols), self.bias_vals, accumulate=True)
        if self.stop_rows.numel():
            rows, cols = self.stop_rows, self.stop_cols
            cur = logits[rows, cols]
            logits[rows, cols] = torch.where(self.stop_left > 0, torch.full_like(cur, float("-inf")), cur)

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record one generated token per row (next_token_ids: [B] int64)."""
        if not self.is_active:
            return
        ids = next_token_ids.to(device=self.device, dtype=torch.int64)
        ar = torch.arange(ids.numel(), device=self.device)
        if self.counts is not None:
            self.counts[ar, ids] += 1.0
        if self.seen is not None:
            self.seen[ar, ids] = True
        if self.stop_rows.numel():
            self.stop_left = self.stop_left - 1
            self._max_stop_left -= 1
            self._drop_spent_stops()

    # ---- batch surgery -----------------------------------------------------------------
    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows keep[0], keep[1], ... (distinct indices, any order) as the new rows."""
        b = self.batch_size
        keep_t = torch.as_tensor(list(keep), dtype=torch.int64, device=self.device)
        self.frequency = [self.frequency[i] for i in keep]
        self.presence = [self.presence[i] for i in keep]
        self.repetition = [self.repetition[i] for i in keep]
        if self.counts is not None:
            self.counts = self.counts[keep_t]
        if self.seen is not None:
            self.seen = self.seen[keep_t]
        if self.bias_rows.numel():
            self.bias_rows, self.bias_cols, self.bias_vals = _pairs_filter(
                self.bias_rows, keep_t, b, self.bias_cols, self.bias_vals
            )
        if self.stop_rows.numel():
            self.stop_rows, self.stop_cols, self.stop_left = _pairs_filter(
                self.stop_rows, keep_t, b, self.stop_cols, self.stop_left
            )
            self._max_stop_left = int(self.stop_left.max()) if self.stop_left.numel() else 0
        self._refresh()

    def merge(self, other: BatchedPenalizer) -> None:
        """Append other's rows after this batch's rows (other is left unusable)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge batches with vocab sizes {self.vocab_size} and {other.vocab_size}")
        b, ob = self.batch_size, other.batch_size
        self.counts = self._cat_dense(self.counts, other.counts, b, ob, torch.float32)
        self.seen = self._cat_dense(self.seen, other.seen, b, ob, torch.bool)
        self.frequency = self.frequency + other.frequency
        self.presence = self.presence + other.presence
        self.repetition = self.repetition + other.repetition
        self.bias_rows = torch.cat([self.bias_rows, other.bias_rows + b])
        self.bias_cols = torch.cat([self.bias_cols, other.bias_cols])
        self.bias_vals = torch.cat([self.bias_vals, other.bias_vals])
        self.stop_rows = torch.cat([self.stop_rows, other.stop_rows + b])
        self.stop_cols = torch.cat([self.stop_cols, other.stop_cols])
        self.stop_left = torch.cat([self.stop_left, other.stop_left])
        self._max_stop_left = max(self._max_stop_left, other._max_stop_left)
        self._refresh()

    def _cat_dense(
        self,
        a: torch.Tensor | None,
        b: torch.Tensor | None,
        na: int,
        nb: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        if a is None and b is None:
            return None
        shape_a, shape_b = (na, self.vocab_size), (nb, self.vocab_size)
        if a is None:
            a = torch.zeros(shape_a, dtype=dtype, device=self.device)
        if b is None:
            b = torch.zeros(shape_b, dtype=dtype, device=self.device)
        return torch.cat([a, b])
