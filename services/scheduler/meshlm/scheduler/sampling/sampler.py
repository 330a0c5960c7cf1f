"""Sampler: turn the last-position logits of a batch into next tokens (and logprobs).

Pipeline of ``Sampler.forward`` (SGLang's order):

1. ``info.apply_logits_bias(logits)`` -- done here, in place on the caller's tensor, so the
   caller must not apply it as well.
2. All rows greedy: ``argmax``. Otherwise ``logits / temperature``; ``probs = softmax``;
   top-k, then top-p over the top-k-renormalized mass, then min-p (tokens below
   ``min_p * max_prob``) zero out probabilities; the surviving mass is sampled by inverse
   CDF, which renormalizes implicitly. Greedy rows of a mixed batch take the argmax of the
   step-1 logits, so ``top_k == 1`` equals ``argmax`` exactly.
3. Logprobs, when asked, are ``log_softmax(logits / temperature)`` -- after penalties,
   before top-k/top-p/min-p. Greedy rows from temperature 0 have temperature 1, so theirs
   are the model's own logprobs.

Seeding: a row with ``sampling_seed`` draws from its own ``torch.Generator`` seeded from a
hash of ``(seed, positions[i])``; its token depends only on its own logits row, seed and
position, never on the rest of the batch. Unseeded rows share the global torch RNG and are
sampled in one vectorized call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from meshlm.scheduler.sampling.sampling_batch_info import SamplingBatchInfo

__all__ = ["LogprobOutput", "SampleOutput", "Sampler", "compute_logprobs", "step_seed"]

TopList = list[tuple[float, int]]
TOP_P_CANDIDATES = 256  # top-p first looks for its cutoff among this many top tokens
_MASK64 = (1 << 64) - 1


@dataclass
class SampleOutput:
    """Result of one sampling step for B requests."""

    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: torch.Tensor | None = None  # [B] float32, logprob of the token
    top_logprobs: list[TopList] | None = None  # per row: top-k (logprob, id), descending
    token_ids_logprobs: list[TopList | None] | None = None  # per row: (logprob, id)


@dataclass
class LogprobOutput:
    """Result of compute_logprobs for N rows."""

    token_logprobs: torch.Tensor | None  # [N] float32; None when no targets were given
    top_logprobs: list[TopList] | None
    token_ids_logprobs: list[TopList | None] | None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, output position); stable across runs."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


def compute_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor | None,
    top_logprobs_nums: Sequence[int] | None = None,
    token_ids_logprobs: Sequence[Sequence[int] | None] | None = None,
    temperatures: torch.Tensor | None = None,
) -> LogprobOutput:
    """Logprobs of logits [N, V] (divided by temperatures [N, 1] when given).

    Returns the logprob of target_ids [N] (if given), per row the top ``top_logprobs_nums[i]``
    (logprob, token id) pairs in descending order (empty for 0), and per row the (logprob, id)
    pairs of ``token_ids_logprobs[i]`` (None where that entry is None).
    """
    x = logits.float()
    if temperatures is not None:
        x = x / temperatures
    logprobs = torch.log_softmax(x, dim=-1)
    token_lp: torch.Tensor | None = None
    if target_ids is not None:
        token_lp = logprobs.gather(1, target_ids.view(-1, 1).to(torch.int64)).view(-1)
    tops: list[TopList] | None = None
    if top_logprobs_nums is not None:
        kmax = min(max(top_logprobs_nums, default=0), logprobs.shape[-1])
        tops = [[] for _ in top_logprobs_nums]
        if kmax > 0:
            vals, ids = logprobs.topk(kmax, dim=-1)
            vals_l, ids_l = vals.tolist(), ids.tolist()
            tops = [list(zip(vals_l[i][:k], ids_l[i][:k])) for i, k in enumerate(top_logprobs_nums)]
    by_ids: list[TopList | None] | None = None
    if token_ids_logprobs is not None:
        by_ids = []
        for i, ids_i in enumerate(token_ids_logprobs):
            if ids_i is None:
                by_ids.append(None)
                continue
            idx = torch.as_tensor(list(ids_i), dtype=torch.int64, device=logprobs.device)
            by_ids.append(list(zip(logprobs[i, idx].tolist(), list(ids_i))))
    return LogprobOutput(token_lp, tops, by_ids)


def _rows(idx: list[int], batch_size: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor for a subset of rows, or None when the subset is every row."""
    if len(idx) == batch_size:
        return None
    return torch.as_tensor(idx, dtype=torch.int64, device=device)


def _cutoffs_from_top(
    vals: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cutoff from each row's K largest probabilities vals [R, K] (descending).

    The kept set is the first k entries, then the shortest prefix of them whose mass reaches
    ``p`` times their total (top-p over the top-k-renormalized distribution; a row without
    top-k totals 1, as softmax rows do). Returns (cutoff [R, 1], resolved [R]): tokens with
    probability below the cutoff are dropped; a row is unresolved when its top-p prefix may
    extend past the K candidates.
    """
    num = vals.shape[1]
    ks_col, ps_col = ks.view(-1, 1), ps.view(-1, 1)
    in_k = torch.arange(num, device=vals.device).view(1, -1) < ks_col
    vals_k = vals.masked_fill(~in_k, 0.0)
    has_k = ks_col < vocab_size
    total = torch.where(has_k, vals_k.sum(dim=-1, keepdim=True), torch.ones_like(ps_col))
    before = torch.nn.functional.pad(vals_k.cumsum(dim=-1)[:, :-1], (1, 0))
    keep = in_k & ((before < ps_col * total) | (ps_col >= 1.0))
    kept = keep.sum(dim=-1, keepdim=True).clamp(min=1)
    cutoff = vals.gather(1, kept - 1)
    cutoff = torch.where(~has_k & (ps_col >= 1.0), torch.zeros_like(cutoff), cutoff)
    resolved = (kept < num) | has_k | (ps_col >= 1.0)
    return cutoff, resolved.view(-1)


def _apply_top_k_top_p(probs: torch.Tensor, info: SamplingBatchInfo, idx: list[int]) -> None:
    """Zero the probabilities that top-k / top-p remove from rows idx (ties at a cutoff stay).

    Avoids a full sort: the cutoff comes from the top ``max(k, TOP_P_CANDIDATES)`` entries,
    and only rows whose top-p set is larger than that are sorted in full.
    """
    v = info.vocab_size
    rows = _rows(idx, probs.shape[0], probs.device)
    sub = probs if rows is None else probs[rows]
    ks = info.top_ks if rows is None else info.top_ks[rows]
    ps = info.top_ps if rows is None else info.top_ps[rows]
    need_p = any(info.top_ps_cpu[i] < 1.0 for i in idx)
    num = max([info.top_ks_cpu[i] for i in idx if info.top_ks_cpu[i] < v], default=1)
    num = min(v, max(num, TOP_P_CANDIDATES) if need_p else num)
    cutoff, resolved = _cutoffs_from_top(sub.topk(num, dim=-1).values, ks, ps, v)
    if need_p and num < v:
        redo = (~resolved).nonzero().view(-1)
        if redo.numel():
            full = sub[redo].sort(dim=-1, descending=True).values
            cutoff[redo] = _cutoffs_from_top(full, ks[redo], ps[redo], v)[0]
    sub.masked_fill_(sub < cutoff, 0.0)
    if rows is not None:
        probs[rows] = sub


def _apply_min_p(probs: torch.Tensor, info: SamplingBatchInfo) -> None:
    """Zero probabilities below min_p * max_prob (rows with min_p 0 are unchanged)."""
    thresh = probs.amax(dim=-1, keepdim=True) * info.min_ps.view(-1, 1)
    probs.masked_fill_(probs < thresh, 0.0)


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of rows of unnormalized probs [R, V] with uniforms [R] in [0, 1).

    The target ``u * total`` is kept strictly below the total, so the first index whose
    cumulative mass exceeds it has positive probability; a row whose pick still has zero
    probability (NaN input) falls back to its argmax.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    below = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniform.view(-1, 1).to(cdf.dtype) * total, below)
    ids = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
    bad = probs.gather(1, ids) <= 0
    if bool(bad.any()):
        ids = torch.where(bad, probs.argmax(dim=-1, keepdim=True), ids)
    return ids.view(-1)


class Sampler:
    """Stateless sampler; see the module docstring for the pipeline.

    `argmax`: row-wise argmax with torch.argmax's result for the logits it `takes` (on CPU,
    kernels/cpu_ops.py's, which runs on every core where torch's runs on one: ~4 ms of a
    [64, 49152] greedy step); torch.argmax for any other tensor.
    """

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        takes: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        self._argmax = argmax
        self._takes = takes

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self._argmax is not None and (self._takes is None or self._takes(logits)):
            return self._argmax(logits)
        return logits.argmax(dim=-1)

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        *,
        positions: Sequence[int] | None = None,
        return_logprob: bool = False,
        top_logprobs_nums: Sequence[int] | None = None,
        token_ids_logprobs: Sequence[Sequence[int] | None] | None = None,
    ) -> SampleOutput:
        """Sample one token per row of logits [B, V] float32 (modified in place by step 1).

        positions[i] is len(output_ids) of request i; required when any row has a seed.
        """
        info.apply_logits_bias(logits)
        scaled = logits if info.all_temperatures_one else logits / info.temperatures
        next_ids = self.argmax(logits) if info.is_all_greedy else self._sample(logits, scaled, info, positions)
        if not return_logprob:
            return SampleOutput(next_ids)
        lp = compute_logprobs(scaled, next_ids, top_logprobs_nums, token_ids_logprobs)
        return SampleOutput(next_ids, lp.token_logprobs, lp.top_logprobs, lp.token_ids_logprobs)

    __call__ = forward

    def _sample(
        self,
        logits: torch.Tensor,
        scaled: torch.Tensor,
        info: SamplingBatchInfo,
        positions: Sequence[int] | None,
    ) -> torch.Tensor:
        """Sample every row from softmax(scaled) after filtering; greedy rows take argmax."""
        probs = torch.softmax(scaled, dim=-1)
        v = info.vocab_size
        sampled = [i for i, g in enumerate(info.is_greedy_cpu) if not g]
        if info.need_top_k or info.need_top_p:
            filt = [i for i in sampled if info.top_ks_cpu[i] < v or info.top_ps_cpu[i] < 1.0]
            _apply_top_k_top_p(probs, info, filt)
        if info.need_min_p:
            _apply_min_p(probs, info)

        b, dev = probs.shape[0], probs.device
        unseeded = [i for i in sampled if info.seeds[i] is None]
        seeded = [(i, seed) for i in sampled if (seed := info.seeds[i]) is not None]
        if len(unseeded) == b:
            next_ids = _draw(probs, torch.rand(b, device=dev))
        else:
            next_ids = torch.empty(b, dtype=torch.int64, device=dev)
            if unseeded:
                rows = torch.as_tensor(unseeded, dtype=torch.int64, device=dev)
                next_ids[rows] = _draw(probs[rows], torch.rand(len(unseeded), device=dev))
        if seeded and positions is None:
            raise ValueError("positions are required when a request has a sampling_seed")
        for i, seed in seeded:
            assert positions is not None  # checked above
            gen = torch.Generator(device=dev)
            gen.manual_seed(step_seed(int(seed), int(positions[i])))
            next_ids[i] = _draw(probs[i : i + 1], torch.rand(1, generator=gen, device=dev))[0]
        greedy = [i for i, g in enumerate(info.is_greedy_cpu) if g]
        if greedy:
            rows = torch.as_tensor(greedy, dtype=torch.int64, device=dev)
            next_ids[rows] = self.argmax(logits[rows])
        return next_ids
