"""Tests for meshlm.scheduler.sampling's Sampler: greedy, seeded sampling (independent of the batch),
top-k / top-p / min-p support, frequencies, logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from sampling_testlib import V, info_for, req

from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.sampling import Sampler, compute_logprobs
from meshlm.scheduler.sampling.sampler import TOP_P_CANDIDATES


def _samplers() -> list[Sampler]:
    """The plain sampler and the one a CPU worker builds (the C argmax of kernels/cpu_ops.py)."""
    from meshlm.scheduler.kernels.build import KernelUnavailable
    from meshlm.scheduler.kernels.cpu_ops import load_cpu_ops

    try:
        ops = load_cpu_ops()
    except KernelUnavailable:  # pragma: no cover - the CI machine has gcc
        return [Sampler()]
    return [Sampler(), Sampler(ops.argmax, ops.supports_argmax)]


@pytest.mark.parametrize("which", [0, 1])
def test_greedy_equals_argmax(which: int) -> None:
    samplers = _samplers()
    if which >= len(samplers):
        pytest.skip("no C compiler")
    torch.manual_seed(6)
    logits = torch.randn(6, V)
    logits[0, :4] = 3.0  # ties: argmax picks the first index
    reqs = [
        req(temperature=0.0),
        req(top_k=1, temperature=0.7),
        req(temperature=0.9),
        req(top_p=0.3),
        req(temperature=0.0),
        req(min_p=0.2, sampling_seed=3),
    ]
    for batch in (reqs, [reqs[0], reqs[1], reqs[4]]):
        n = len(batch)
        out = samplers[which](logits[:n].clone(), info_for(batch), positions=[0] * n)
        greedy = [i for i, r in enumerate(batch) if r.sampling_params.is_greedy]
        assert torch.equal(out.next_token_ids[greedy], logits[:n].argmax(-1)[greedy])
    assert info_for([reqs[0], reqs[1]]).is_all_greedy


def _flat_logits(n: int, vocab: int = 1000) -> torch.Tensor:
    return torch.zeros(n, vocab)


def _draw_seq(seed: int, steps: int, batch_extra: list[Req], vocab: int = 1000) -> list[int]:
    r = req(sampling_seed=seed, vocab=vocab)
    info = info_for(batch_extra + [r], vocab)
    torch.manual_seed(1234)
    logits = torch.randn(len(batch_extra) + 1, vocab)
    toks = []
    for pos in range(steps):
        lg = logits.clone()
        lg[-1] = torch.linspace(-1.0, 1.0, vocab)
        out = Sampler()(lg, info, positions=[pos] * (len(batch_extra) + 1))
        toks.append(int(out.next_token_ids[-1]))
    return toks


def test_same_seed_same_samples_and_steps_differ() -> None:
    a = _draw_seq(11, 20, [])
    b = _draw_seq(11, 20, [])
    assert a == b
    assert len(set(a)) > 10  # each step gets its own draw


def test_different_seeds_differ_on_flat_distribution() -> None:
    sampler = Sampler()
    vocab = 1000
    infos = [info_for([req(sampling_seed=s, vocab=vocab)], vocab) for s in (1, 2)]
    seqs = [[int(sampler(_flat_logits(1), inf, positions=[p]).next_token_ids[0]) for p in range(50)] for inf in infos]
    assert sum(x != y for x, y in zip(*seqs)) >= 45


def test_seeded_row_independent_of_batch_composition() -> None:
    alone = _draw_seq(5, 20, [])
    others = [
        req(temperature=0.0, vocab=1000),
        req(top_p=0.5, top_k=30, vocab=1000),
        req(min_p=0.1, sampling_seed=99, vocab=1000),
        req(temperature=1.7, vocab=1000),
    ]
    assert _draw_seq(5, 20, others) == alone
    assert _draw_seq(5, 20, others[1:3]) == alone


def test_seed_requires_positions() -> None:
    with pytest.raises(ValueError, match="positions"):
        Sampler()(torch.zeros(1, V), info_for([req(sampling_seed=1)]))


def _support(logits_row: torch.Tensor, n: int = 3000, **kw: Any) -> torch.Tensor:
    vocab = logits_row.numel()
    info = info_for([req(vocab=vocab, **kw)] * n, vocab)
    out = Sampler()(logits_row.repeat(n, 1), info)
    return torch.bincount(out.next_token_ids, minlength=vocab)


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


@pytest.mark.parametrize(
    "kw,kept",
    [
        ({"top_p": 0.65}, 2),  # 0.4 + 0.3 >= 0.65
        ({"top_p": 0.8}, 3),
        ({"top_p": 0.05}, 1),
        ({"top_k": 2}, 2),
        ({"top_k": 3, "top_p": 0.8}, 2),  # top-p over the renormalized top-3: 0.47, 0.82
        ({"min_p": 0.3}, 3),  # threshold 0.12
        ({"min_p": 0.8}, 1),
        ({}, 5),
    ],
)
def test_filter_support(kw: dict[str, Any], kept: int) -> None:
    counts = _support(PROBS.log(), **kw)
    assert (counts[:kept] > 0).all() and (counts[kept:] == 0).all(), counts


def test_unfiltered_sampling_frequencies() -> None:
    torch.manual_seed(7)
    counts = _support(PROBS.log() * 2.0, n=20000, temperature=2.0)
    assert torch.allclose(counts / 20000.0, PROBS, atol=0.015)


@pytest.mark.parametrize("peaked", [False, True])
def test_top_p_large_vocab(peaked: bool) -> None:
    """Cutoff found inside the candidate window (peaked) or by the full-sort fallback (flat)."""
    vocab = 4 * TOP_P_CANDIDATES
    pos = torch.arange(vocab, dtype=torch.float64)
    weights = torch.exp(-pos / 8.0) if peaked else torch.linspace(2.0, 1.0, vocab).double()
    probs = weights / weights.sum()
    top_p = 0.55 if not peaked else 0.83
    before = probs.cumsum(0) - probs
    expected = int((before < top_p).sum())
    assert min(float(before[expected] - top_p), float(top_p - before[expected - 1])) > 1e-4
    assert (expected > TOP_P_CANDIDATES) != peaked
    counts = _support(probs.log().float(), n=4000, top_p=top_p)
    nz = counts.nonzero().view(-1)
    assert int(nz.max()) < expected and int(nz.max()) >= 0.9 * (expected - 1)


def test_logprobs_are_temperature_scaled_log_softmax() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, V)
    reqs = [req(temperature=0.5), req(temperature=0.0, logit_bias={"2": 1.5}), req(temperature=2.0, top_k=4)]
    biased = logits.clone()
    biased[1, 2] += 1.5
    temps = torch.tensor([[0.5], [1.0], [2.0]])
    ref = torch.log_softmax(biased / temps, dim=-1)
    out = Sampler()(
        logits.clone(),
        info_for(reqs),
        return_logprob=True,
        top_logprobs_nums=[3, 0, 5],
        token_ids_logprobs=[[1, 2], None, [0]],
    )
    ids = out.next_token_ids
    assert ids[1] == biased[1].argmax()
    assert out.next_token_logprobs is not None
    assert torch.allclose(out.next_token_logprobs, ref.gather(1, ids.view(-1, 1)).view(-1))
    assert out.top_logprobs is not None and out.token_ids_logprobs is not None
    assert out.top_logprobs[1] == []
    for i, k in ((0, 3), (2, 5)):
        vals, tops = ref[i].topk(k)
        got = out.top_logprobs[i]
        assert [t for _, t in got] == tops.tolist()
        assert [v for v, _ in got] == pytest.approx(vals.tolist(), abs=1e-5)
        assert all(a[0] >= b[0] for a, b in zip(got, got[1:]))
    assert out.token_ids_logprobs[1] is None
    assert [t for _, t in out.token_ids_logprobs[0]] == [1, 2]
    assert out.token_ids_logprobs[0][1][0] == pytest.approx(float(ref[0, 2]), abs=1e-5)
    assert out.token_ids_logprobs[2][0][0] == pytest.approx(float(ref[2, 0]), abs=1e-5)
    plain = Sampler()(logits.clone(), info_for(reqs))
    assert plain.next_token_logprobs is None and plain.top_logprobs is None


def test_compute_logprobs_helper() -> None:
    torch.manual_seed(9)
    logits = torch.randn(4, V)
    targets = torch.tensor([0, 5, 9, V - 1])
    res = compute_logprobs(logits, targets, top_logprobs_nums=[1, 2, 0, V + 5])
    ref = torch.log_softmax(logits, -1)
    assert res.token_logprobs is not None and res.top_logprobs is not None
    assert torch.allclose(res.token_logprobs, ref[torch.arange(4), targets])
    assert res.top_logprobs[0][0][1] == int(ref[0].argmax())
    assert len(res.top_logprobs[3]) == V and res.top_logprobs[2] == []
    assert res.token_ids_logprobs is None
    assert math.isclose(sum(math.exp(v) for v, _ in res.top_logprobs[3]), 1.0, rel_tol=1e-4)
