"""meshlm.common.sampling_rules: the one rule set of sampling parameters (tokenizer, scheduler
and the gateway's bounds), torch-free."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from meshlm.common.sampling_rules import (
    DEFAULT_MAX_NEW_TOKENS,
    RANGES,
    InvalidArgument,
    Range,
    check_sampling_params,
    check_token_ids,
)


def test_ranges_describe_and_bounds() -> None:
    names = ("top_p", "min_p", "presence_penalty", "temperature")
    assert [RANGES[n].describe() for n in names] == [
        "in (0, 1]",
        "in [0, 1]",
        "in [-2, 2]",
        ">= 0",
    ]
    assert RANGES["top_k"].describe() == "-1 (whole vocabulary) or in [1, 2147483647]"
    assert RANGES["n"].describe() == "in [1, 128]"
    assert RANGES["top_p"].bounds() == {"gt": 0, "le": 1}
    assert RANGES["repetition_penalty"].bounds() == {"gt": 0, "le": 2}
    assert RANGES["temperature"].bounds(le=2) == {"ge": 0, "le": 2}
    with pytest.raises(TypeError):
        RANGES["n"].bounds(maximum=3)
    assert Range(integer=True).describe() == ""


@pytest.mark.parametrize(
    "name, good, bad",
    [
        ("top_p", [1, 1.0, 1e-9], [0, 1.5, float("nan"), True, "0.5"]),
        ("top_k", [-1, 1, 1 << 30], [0, -2, 2.5, "1"]),
        ("temperature", [0, 0.0, 7.5], [-1e-9, float("inf")]),
        ("max_new_tokens", [0, 5], [-1, 1.0, False]),
        ("sampling_seed", [-5, 0, 1 << 62], ["x", 1.5]),
    ],
)
def test_range_allows(name: str, good: list[Any], bad: list[Any]) -> None:
    rule = RANGES[name]
    assert all(rule.allows(v) for v in good)
    assert not any(rule.allows(v) for v in bad)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"top_p": 1.5}, "sampling_params.top_p must be in (0, 1], got 1.5"),
        ({"n": 0}, "sampling_params.n must be in [1, 128], got 0"),
        ({"n": "2"}, "sampling_params.n must be an integer in [1, 128], got '2'"),
        (
            {"sampling_seed": 1.5},
            "sampling_params.sampling_seed must be an integer in [-9223372036854775808, 9223372036854775807], got 1.5",
        ),
        (
            {"min_new_tokens": DEFAULT_MAX_NEW_TOKENS + 1},
            f"sampling_params.min_new_tokens ({DEFAULT_MAX_NEW_TOKENS + 1}) must be <= "
            f"max_new_tokens ({DEFAULT_MAX_NEW_TOKENS})",
        ),
        ({"ignore_eos": "yes"}, "sampling_params.ignore_eos must be true or false, got 'yes'"),
        ({"regex": 3}, "sampling_params.regex must be a string, got int"),
        (
            {"regex": "a", "ebnf": "root ::= 'a'"},
            "sampling_params.regex and ebnf are both set; only one of json_schema, regex and ebnf may be set",
        ),
        (
            {"json_schema": '{"type": '},
            "sampling_params.json_schema is not valid JSON: Expecting value: line 1 column 10 (char 9)",
        ),
        (
            {"json_schema": '"object"'},
            "sampling_params.json_schema must be a JSON object (a JSON Schema), got str",
        ),
        ({"stop": [1]}, "sampling_params.stop must be a string or a list of strings, got [1]"),
        ({"stop": ""}, "sampling_params.stop[0] is empty; stop strings need at least 1 character"),
        (
            {"stop_token_ids": "1"},
            "sampling_params.stop_token_ids must be a list of token ids (integers), got '1'",
        ),
        (
            {"logit_bias": {"x": 1.0}},
            "sampling_params.logit_bias key 'x' is not a token id (an integer >= 0)",
        ),
        (
            {"logit_bias": {"3": "a"}},
            "sampling_params.logit_bias['3'] must be a finite number, got 'a'",
        ),
        ({"custom_params": []}, "sampling_params.custom_params must be an object (dict), got []"),
        # wire ranges and sizes (meshlm.common.input_limits)
        ({"max_new_tokens": 1 << 31}, "sampling_params.max_new_tokens must be in [0, 2147483647], got 2147483648"),
        ({"n": 129}, "sampling_params.n must be in [1, 128], got 129"),
        ({"stop": ["s"] * 65}, "sampling_params.stop has 65 strings; at most 64 are allowed"),
        ({"stop": ["x" * 1025]}, "sampling_params.stop[0] has 1025 characters; at most 1024 are allowed"),
        ({"stop_token_ids": [1] * 1025}, "sampling_params.stop_token_ids has 1025 entries; at most 1024 are allowed"),
        (
            {"logit_bias": {i: 0.0 for i in range(1025)}},
            "sampling_params.logit_bias has 1025 entries; at most 1024 are allowed",
        ),
    ],
)
def test_messages_name_field_limit_and_value(values: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_sampling_params(values)
    assert str(exc.value) == message
    assert isinstance(exc.value, ValueError)


def test_unset_and_none_are_defaults_and_vocabulary_needs_a_size() -> None:
    check_sampling_params({})
    check_sampling_params({name: None for name in RANGES})
    # max_new_tokens=None is "no limit": min_new_tokens is not bounded by the default
    check_sampling_params({"max_new_tokens": None, "min_new_tokens": 10_000})
    check_sampling_params({"stop_token_ids": [10**9], "logit_bias": {10**9: 1.0}})
    with pytest.raises(InvalidArgument, match=r"stop_token_ids\[0\] = 64 is out of the vocabulary"):
        check_sampling_params({"stop_token_ids": [64]}, vocab_size=64)
    out = r"logit_bias key 64 is out of the vocabulary; token ids must be in \[0, 64\)"
    with pytest.raises(InvalidArgument, match=out):
        check_sampling_params({"logit_bias": {"64": 1.0}}, vocab_size=64)
    check_sampling_params({"stop_token_ids": {0, 63}, "logit_bias": {63: -1}}, vocab_size=64)
    with pytest.raises(InvalidArgument, match=r"^prompt\[1\] = -1 is out of the vocabulary"):
        check_token_ids([0, -1], "prompt", 64)


def test_no_torch() -> None:
    code = "import sys, meshlm.common.sampling_rules; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
