"""Tests for meshlm.scheduler.sampling's penalties and batch info: frequency, presence and
repetition penalties against references, logit bias, min_new_tokens, cumulate / filter / merge."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sampling_testlib import V, info_for, req

from meshlm.scheduler.sampling import SamplingBatchInfo


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
