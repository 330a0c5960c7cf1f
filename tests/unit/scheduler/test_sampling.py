"""Tests for meshlm.scheduler.sampling: params validation, penalties, batch info and sampler."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.sampling import (
    TOP_K_ALL,
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    compute_logprobs,
)
from meshlm.scheduler.sampling.sampler import TOP_P_CANDIDATES

V = 64


def params(vocab: int = V, **kw: Any) -> SamplingParams:
    sp = SamplingParams(**kw)
    sp.verify(vocab)
    sp.normalize(None)
    return sp


def req(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    vocab: int = V,
    **kw: Any,
) -> Req:
    sp = params(vocab, **kw)
    r = Req("r", prompt if prompt is not None else [1, 2, 3], sp, eos_token_ids=eos)
    r.output_ids = list(output or [])
    return r


def info_for(reqs: list[Any], vocab: int = V) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")


# ---- SamplingParams ----------------------------------------------------------------------


def test_defaults_match_sglang() -> None:
    sp = SamplingParams()
    expected = dict(
        max_new_tokens=128,
        min_new_tokens=0,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        stop=None,
        stop_token_ids=None,
        ignore_eos=False,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        no_stop_trim=False,
        n=1,
        logit_bias=None,
        sampling_seed=None,
        stream_interval=None,
        json_schema=None,
        regex=None,
        ebnf=None,
        custom_params=None,
    )
    for name, value in expected.items():
        assert getattr(sp, name) == value, name
    sp.verify(V)
    sp.normalize(None)
    assert sp.top_k == TOP_K_ALL == 1 << 30
    assert sp.stop_strs == [] and sp.stop_str_max_len == 0
    assert not sp.is_greedy


def test_from_dict_unknown_key_and_none_defaults() -> None:
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"temperature": 0.5, "bogus": 1})
    with pytest.raises(ValueError, match="stop_strs"):
        SamplingParams.from_dict({"stop_strs": ["x"]})
    sp = SamplingParams.from_dict({"temperature": None, "top_k": None, "n": None, "max_new_tokens": 7, "top_p": 0.5})
    assert (sp.temperature, sp.top_k, sp.n, sp.max_new_tokens, sp.top_p) == (1.0, -1, 1, 7, 0.5)
    assert SamplingParams(max_new_tokens=None).max_new_tokens is None  # up to the context
    assert SamplingParams(temperature=None, ignore_eos=None).ignore_eos is False


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": -1.0}, "sampling_params.temperature must be >= 0, got -1.0"),
        (
            {"temperature": float("nan")},
            "sampling_params.temperature must be a finite number >= 0, got nan",
        ),
        (
            {"top_k": 2.5},
            "sampling_params.top_k must be an integer -1 (whole vocabulary) or >= 1, got 2.5",
        ),
        (
            {"stop_token_ids": [V]},
            f"sampling_params.stop_token_ids[0] = {V} is out of the vocabulary; token ids must be in [0, {V})",
        ),
        (
            {"stop": ["a", ""]},
            "sampling_params.stop[1] is empty; stop strings need at least 1 character",
        ),
    ],
)
def test_verify_message_names_field_range_and_value(kw: dict[str, Any], message: str) -> None:
    """The messages are meshlm.common.sampling_rules', the same the tokenizer sends."""
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kw).verify(V)
    assert str(exc.value) == message


BAD_CASES = [
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": float("inf")}),
    ("temperature", {"temperature": "0.5"}),
    ("temperature", {"temperature": True}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -3}),
    ("presence_penalty", {"presence_penalty": "a"}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": 2.01}),
    ("max_new_tokens", {"max_new_tokens": -1}),
    ("max_new_tokens", {"max_new_tokens": "10"}),
    ("min_new_tokens", {"min_new_tokens": -1}),
    ("min_new_tokens", {"min_new_tokens": 10, "max_new_tokens": 5}),
    ("logit_bias", {"logit_bias": {str(V): 1.0}}),
    ("logit_bias", {"logit_bias": {"-1": 1.0}}),
    ("logit_bias", {"logit_bias": {"abc": 1.0}}),
    ("logit_bias", {"logit_bias": {"5": float("inf")}}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("stop_token_ids", {"stop_token_ids": [V]}),
    ("stop_token_ids", {"stop_token_ids": ["1"]}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ""}),
    ("n", {"n": 0}),
    ("stream_interval", {"stream_interval": 0}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("sampling_seed", {"sampling_seed": "x"}),
    ("json_schema", {"json_schema": "{}"}),
    ("regex", {"regex": "a+"}),
    ("ebnf", {"ebnf": "root ::= 'a'"}),
]


@pytest.mark.parametrize(
    "field,kw",
    BAD_CASES,
    ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CASES)],
)
def test_verify_rejects(field: str, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field) as exc:
        SamplingParams(**kw).verify(V)
    assert str(exc.value).startswith(f"sampling_params.{field}")
    if field in ("json_schema", "regex", "ebnf"):
        assert "not implemented" in str(exc.value)


@pytest.mark.parametrize(
    "pb",
    [
        {"top_p": 1.5},
        {"temperature": -1},
        {"n": 0},
        {"min_new_tokens": 9, "max_new_tokens": 4},
        {"stop": ["a", ""]},
        {"stop_token_ids": [V]},
        {"logit_bias": {V + 1: 1.0}},
        {"ebnf": "root ::= 'a'"},
    ],
)
def test_tokenizer_and_scheduler_apply_the_same_rules(pb: dict[str, Any]) -> None:
    """One rule set: a proto the tokenizer rejects gets the same message from the scheduler."""
    from meshlm.scheduler.service.wire import sampling_params_from_proto
    from meshlm.tokenizer.request import InvalidRequest, verify_sampling_params
    from meshlm.v1 import common_pb2

    proto = common_pb2.SamplingParams(**pb)
    with pytest.raises(InvalidRequest) as at_tokenizer:
        verify_sampling_params(proto, V)
    with pytest.raises(ValueError) as at_scheduler:
        sampling_params_from_proto(proto).verify(V)
    assert str(at_tokenizer.value) == str(at_scheduler.value)


def test_verify_accepts_edges() -> None:
    ok = [
        {"temperature": 0},
        {"top_p": 1.0, "min_p": 1.0, "top_k": 1},
        {"top_k": -1},
        {"top_k": TOP_K_ALL},
        {"repetition_penalty": 2.0, "frequency_penalty": -2, "presence_penalty": 2},
        {"max_new_tokens": None, "min_new_tokens": 1000},
        {"max_new_tokens": 4, "min_new_tokens": 4},
        {"logit_bias": {"0": -100.0, str(V - 1): 5}, "stop_token_ids": [0, V - 1]},
        {"stop": ["a", "bc"], "stream_interval": 2, "sampling_seed": -5, "n": 3},
    ]
    for kw in ok:
        sp = SamplingParams(**kw)
        sp.verify(V)
        sp.normalize(None)
        sp.verify(V)


class _ListTok:
    def encode(self, s: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) for c in s.split()] if s.strip() else []


class _EncodingTok:
    def encode(self, s: str, add_special_tokens: bool = True) -> SimpleNamespace:
        assert add_special_tokens is False
        return SimpleNamespace(ids=list(range(len(s) // 2)))


def test_normalize_stop_strings_and_greedy() -> None:
    sp = SamplingParams(stop="a b c")
    sp.normalize(_ListTok())
    assert sp.stop_strs == ["a b c"] and sp.stop_str_max_len == 3
    sp = SamplingParams(stop=["abcdef", "xy"])
    sp.normalize(_EncodingTok())
    assert sp.stop_strs == ["abcdef", "xy"] and sp.stop_str_max_len == 3
    sp.normalize(None)
    assert sp.stop_str_max_len == 6  # characters without a tokenizer

    sp = SamplingParams(temperature=0.0, top_k=40)
    sp.normalize(None)
    assert (sp.temperature, sp.top_k, sp.is_greedy) == (1.0, 1, True)
    sp.normalize(None)  # idempotent
    assert (sp.temperature, sp.top_k) == (1.0, 1)
    sp = SamplingParams(temperature=1e-7)
    sp.normalize(None)
    assert sp.is_greedy
    sp = SamplingParams(temperature=0.5, top_k=-1)
    sp.normalize(None)
    assert (sp.temperature, sp.top_k, sp.is_greedy) == (0.5, TOP_K_ALL, False)


# ---- penalties ---------------------------------------------------------------------------


def _apply(reqs: list[Any], logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    info_for(reqs).apply_logits_bias(out)
    return out


def _ref_repetition(row: torch.Tensor, seen: set[int], p: float) -> torch.Tensor:
    row = row.clone()
    for t in seen:
        row[t] = row[t] / p if row[t] > 0 else row[t] * p
    return row


def test_no_penalties_allocates_nothing() -> None:
    info = info_for([req(temperature=0.7), req(top_p=0.5, output=[1, 2])])
    pen = info.penalizer
    assert pen.counts is None and pen.seen is None and not pen.is_active
    logits = torch.randn(2, V)
    out = logits.clone()
    info.apply_logits_bias(out)
    info.cumulate_output_tokens(torch.tensor([1, 2]))
    assert torch.equal(out, logits)


def test_frequency_and_presence_penalty_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    out_ids = [3, 3, 7, 9, 3]
    reqs = [
        req(prompt=[5, 6], output=out_ids, frequency_penalty=0.5),
        req(prompt=[5, 6], output=out_ids, presence_penalty=-1.5),
        req(prompt=[5, 6], output=out_ids),
    ]
    got = _apply(reqs, logits)
    ref = logits.clone()
    for t in set(out_ids):
        ref[0, t] -= 0.5 * out_ids.count(t)
        ref[1, t] -= -1.5
    assert torch.allclose(got, ref, atol=1e-6)
    assert torch.equal(got[2], logits[2])
    assert torch.equal(got[:, 5], logits[:, 5])  # prompt tokens are not penalized


def test_repetition_penalty_reference_positive_and_negative_logits() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    logits[0, 1], logits[0, 2], logits[0, 8] = 2.0, -2.0, 0.0
    prompt, out = [1, 2, 8], [20, 21, 1]
    reqs = [req(prompt=prompt, output=out, repetition_penalty=1.3), req(repetition_penalty=1.0)]
    got = _apply(reqs, logits)
    ref = _ref_repetition(logits[0], set(prompt + out), 1.3)
    assert torch.equal(got[0], ref)
    assert got[0, 1] == pytest.approx(2.0 / 1.3) and got[0, 2] == pytest.approx(-2.6)
    assert torch.equal(got[1], logits[1])


def test_logit_bias_and_combined_order() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, V)
    prompt, out = [4, 5], [5, 6, 6]
    r = req(
        prompt=prompt,
        output=out,
        repetition_penalty=0.8,
        frequency_penalty=0.25,
        presence_penalty=0.5,
        logit_bias={"6": 3.0, "10": -7.5},
    )
    got = _apply([r], logits)[0]
    ref = _ref_repetition(logits[0], set(prompt + out), 0.8)
    for t in set(out):
        ref[t] -= 0.25 * out.count(t) + 0.5
    ref[6] += 3.0
    ref[10] += -7.5
    assert torch.allclose(got, ref, atol=1e-6)


def test_min_new_tokens_masks_stop_ids_until_reached() -> None:
    torch.manual_seed(3)
    eos = frozenset({0})
    reqs = [
        req(eos=eos, min_new_tokens=3, stop_token_ids=[9]),
        req(eos=eos, min_new_tokens=0),
        req(eos=eos, min_new_tokens=2, ignore_eos=True),
        req(eos=eos, output=[7], min_new_tokens=6),
    ]
    info = info_for(reqs)
    for step in range(7):
        logits = torch.randn(4, V)
        got = logits.clone()
        info.apply_logits_bias(got)
        ref = logits.clone()
        if step < 3:
            ref[0, 0] = ref[0, 9] = float("-inf")
        if step < 5:
            ref[3, 0] = float("-inf")
        assert torch.equal(got, ref), step  # row 2: ignore_eos and no stop ids, nothing
        info.cumulate_output_tokens(torch.tensor([5, 5, 5, 5]))
    assert info.penalizer.stop_rows.numel() == 0  # dropped once every row reached its minimum


def test_cumulate_tracks_outputs_like_a_fresh_build() -> None:
    torch.manual_seed(4)
    kw = dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.2)
    reqs = [req(prompt=[1, 2], **kw), req(prompt=[3], output=[4], **kw)]
    info = info_for(reqs)
    for _ in range(6):
        ids = torch.randint(0, V, (2,))
        info.cumulate_output_tokens(ids)
        for r, t in zip(reqs, ids.tolist()):
            r.output_ids.append(t)
        logits = torch.randn(2, V)
        assert torch.equal(_apply(reqs, logits), _apply_with(info, logits))


def _apply_with(info: SamplingBatchInfo, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    info.apply_logits_bias(out)
    return out


def test_filter_and_merge_match_fresh_build() -> None:
    torch.manual_seed(5)
    eos = frozenset({0})
    reqs = [
        req(prompt=[1], frequency_penalty=1.0, eos=eos, min_new_tokens=4),
        req(prompt=[2], temperature=0.0, logit_bias={"3": 2.0}),
        req(prompt=[3, 4], repetition_penalty=1.5, top_k=5, sampling_seed=7),
    ]
    info = info_for(reqs)
    for _ in range(2):
        ids = torch.randint(1, V, (3,))
        info.cumulate_output_tokens(ids)
        for r, t in zip(reqs, ids.tolist()):
            r.output_ids.append(t)
    info.filter_batch([2, 0])
    new = [req(prompt=[5, 6], presence_penalty=0.7, top_p=0.5), req(prompt=[7])]
    info.merge_batch(info_for(new))
    current = [reqs[2], reqs[0]] + new
    fresh = info_for(current)
    logits = torch.randn(4, V)
    assert torch.equal(_apply_with(info, logits), _apply_with(fresh, logits))
    assert info.top_ks_cpu == fresh.top_ks_cpu and info.seeds == fresh.seeds
    assert torch.equal(info.temperatures, fresh.temperatures)
    assert torch.equal(info.top_ps, fresh.top_ps)
    assert (info.need_top_k, info.need_top_p, info.is_all_greedy) == (True, True, False)
    info.filter_batch([3])
    assert not info.penalizer.is_active and info.penalizer.counts is None
    assert len(info) == 1


# ---- sampler -----------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
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
        out = Sampler()(logits[:n].clone(), info_for(batch), positions=[0] * n)
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
