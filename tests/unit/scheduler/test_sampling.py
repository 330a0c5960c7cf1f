"""Tests for meshlm.scheduler.sampling's SamplingParams: defaults, validation (messages naming
field, range and value; the same rules as the tokenizer), normalisation. Penalties and batch info:
test_sampling_penalties.py; the sampler: test_sampler.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from sampling_testlib import V

from meshlm.scheduler.sampling import TOP_K_ALL, SamplingParams

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
            "sampling_params.top_k must be an integer -1 (whole vocabulary) or in [1, 2147483647], got 2.5",
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
    ("json_schema", {"json_schema": "{not json"}),
    ("json_schema", {"json_schema": "[1, 2]"}),
    ("regex", {"regex": 5}),
    ("json_schema", {"json_schema": "{}", "regex": "a+"}),
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
        {"json_schema": "{oops"},
        {"regex": "a", "ebnf": "root ::= 'a'"},
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
