"""The rules of sampling parameters (SGLang's SamplingParams.verify), written once.

Torch- and protobuf-free. The tokenizer checks a request's set proto fields with
`check_sampling_params`, the scheduler's SamplingParams.verify checks its dataclass with the same
function, and the gateway's pydantic models take their numeric bounds from `RANGES`.

Conventions of `check_sampling_params(values, vocab_size)`:
* `values` maps SGLang / proto field names to the values a request set; an absent field (or None)
  is the default and always valid, except that `max_new_tokens=None` means "no limit" while an
  absent one is `DEFAULT_MAX_NEW_TOKENS` (the bound of `min_new_tokens`);
* every violation raises `InvalidArgument` (a ValueError: INVALID_ARGUMENT / HTTP 400)
  whose message names `sampling_params.<field>`, the allowed values and the value given;
* the vocabulary checks (stop_token_ids and logit_bias keys in [0, vocab_size)) run only when a
  vocab_size is given; everything else needs no model;
* integers stay within their proto field's type (max_new_tokens is an int32, sampling_seed an
  int64, ...) and lists within meshlm.common.input_limits (MAX_N samples, MAX_STOP stop strings of
  MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS entries), so a checked value always fits
  the wire and bounds the work of one request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn, TypedDict

from meshlm.common.input_limits import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    InvalidArgument,
)

__all__ = [
    "BOOL_FIELDS",
    "DEFAULT_MAX_NEW_TOKENS",
    "InvalidArgument",
    "RANGES",
    "Range",
    "STRUCTURED_OUTPUT_FIELDS",
    "check_sampling_params",
    "check_token_ids",
    "parse_token_key",
]

FIELD = "sampling_params."  # every message names the field as sampling_params.<name>
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request does not set max_new_tokens
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
STRUCTURED_OUTPUT_FIELDS = ("json_schema", "regex", "ebnf")  # constrained decoding: at most one


class Bounds(TypedDict, total=False):
    """pydantic's Field constraints (ge/gt/le/lt) of a Range."""

    ge: float
    gt: float
    le: float
    lt: float


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric field.

    An integer (bool excluded) when `integer`, else a finite int or float; then within the bounds:
    `low` / `high` (None = unbounded), inclusive unless `low_open` / `high_open`. `extra` is one
    more allowed value outside the bounds (top_k's -1), described by `extra_text`.
    """

    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    extra: int | None = None
    extra_text: str = ""

    def has_type(self, value: Any) -> bool:
        """An integer for an integer field, a finite number for a real one."""
        if isinstance(value, bool):
            return False
        if self.integer:
            return isinstance(value, int)
        return isinstance(value, (int, float)) and math.isfinite(value)

    def allows(self, value: Any) -> bool:
        if not self.has_type(value):
            return False
        if self.extra is not None and value == self.extra:
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        """The bounds in words: ">= 0", "in (0, 1]", "-1 (whole vocabulary) or >= 1"; "" if none."""
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {self.high}"
        else:
            text = ""
        return f"{self.extra_text} or {text}" if self.extra is not None else text

    def bounds(self, **extra: float) -> Bounds:
        """pydantic Field constraints of the bounds (`extra`: a caller's tighter ones, e.g. le=2).
        The `extra` value cannot be expressed this way: a field with one needs a validator."""
        out = Bounds()
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        for key, value in extra.items():
            if key not in ("ge", "gt", "le", "lt"):
                raise TypeError(f"bounds: unknown constraint {key!r}")
            out[key] = value  # type: ignore[literal-required]
        return out

    def check(self, name: str, value: Any) -> None:
        """Raise InvalidArgument unless value is allowed; the message names the field."""
        if self.allows(value):
            return
        text = self.describe()
        if not self.has_type(value):
            kind = "an integer" if self.integer else "a finite number"
            raise InvalidArgument(f"{FIELD}{name} must be {kind}{' ' + text if text else ''}, got {_short(value)}")
        raise InvalidArgument(f"{FIELD}{name} must be {text}, got {_short(value)}")


RANGES: Mapping[str, Range] = MappingProxyType(
    {
        "max_new_tokens": Range(integer=True, low=0, high=INT32_MAX),
        "min_new_tokens": Range(integer=True, low=0, high=INT32_MAX),
        "temperature": Range(low=0),
        "top_p": Range(low=0, low_open=True, high=1),
        "top_k": Range(integer=True, low=1, high=INT32_MAX, extra=-1, extra_text="-1 (whole vocabulary)"),
        "min_p": Range(low=0, high=1),
        "frequency_penalty": Range(low=-2, high=2),
        "presence_penalty": Range(low=-2, high=2),
        "repetition_penalty": Range(low=0, low_open=True, high=2),
        "n": Range(integer=True, low=1, high=MAX_N),
        "stream_interval": Range(integer=True, low=1, high=INT32_MAX),
        "sampling_seed": Range(integer=True, low=INT64_MIN, high=INT64_MAX),
    }
)


_FINITE = Range()  # any finite number


def _short(value: Any) -> str:
    """repr(value), cut to 80 characters (a message must not echo a huge input)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(message: str) -> NoReturn:
    raise InvalidArgument(f"{FIELD}{message}")


def _out_of_vocabulary(what: str, vocab_size: int) -> str:
    return f"{what} is out of the vocabulary; token ids must be in [0, {vocab_size})"


def check_token_ids(ids: Sequence[int], where: str, vocab_size: int) -> None:
    """Every id in [0, vocab_size); the message names `where[pos]`, the id and the bound."""
    for pos, t in enumerate(ids):
        if t < 0 or t >= vocab_size:
            raise InvalidArgument(_out_of_vocabulary(f"{where}[{pos}] = {t}", vocab_size))


def parse_token_key(key: Any) -> int | None:
    """A logit_bias key as an int (JSON gives integer strings), or None when it is not one."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            return None
    return None


def check_sampling_params(values: Mapping[str, Any], vocab_size: int | None = None) -> None:
    """Raise InvalidArgument for the first field of `values` that breaks its rule.

    Module docstring: absent/None fields are defaults; vocabulary checks need vocab_size."""
    for name, rule in RANGES.items():
        value = values.get(name)
        if value is not None:
            rule.check(name, value)
    _check_lengths(values)
    for name in BOOL_FIELDS:
        value = values.get(name)
        if value is not None and not isinstance(value, bool):
            _fail(f"{name} must be true or false, got {value!r}")
    _check_structured_output(values)
    _check_stop(values.get("stop"))
    _check_stop_token_ids(values.get("stop_token_ids"), vocab_size)
    _check_logit_bias(values.get("logit_bias"), vocab_size)
    custom = values.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        _fail(f"custom_params must be an object (dict), got {custom!r}")


def _check_lengths(values: Mapping[str, Any]) -> None:
    min_new = values.get("min_new_tokens")
    max_new = values.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if min_new is not None and max_new is not None and min_new > max_new:
        _fail(f"min_new_tokens ({min_new}) must be <= max_new_tokens ({max_new})")


def _check_structured_output(values: Mapping[str, Any]) -> None:
    """json_schema / regex / ebnf: strings, at most one set, json_schema a JSON object (the
    cheap checks; whether the scheduler's grammar backend compiles them is its own check)."""
    given = [name for name in STRUCTURED_OUTPUT_FIELDS if values.get(name) is not None]
    for name in given:
        if not isinstance(values[name], str):
            _fail(f"{name} must be a string, got {type(values[name]).__name__}")
    if len(given) > 1:
        _fail(f"{given[0]} and {given[1]} are both set; only one of json_schema, regex and ebnf may be set")
    schema = values.get("json_schema")
    if schema is not None:
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            _fail(f"json_schema is not valid JSON: {e}")
        if not isinstance(parsed, (dict, bool)):
            _fail(f"json_schema must be a JSON object (a JSON Schema), got {type(parsed).__name__}")


def _check_stop(stop: Any) -> None:
    """None, one string or a list of strings, none of them empty."""
    if stop is None:
        return
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        _fail(f"stop must be a string or a list of strings, got {_short(stop)}")
    if len(stop) > MAX_STOP:
        _fail(f"stop has {len(stop)} strings; at most {MAX_STOP} are allowed")
    for i, s in enumerate(stop):
        if not s:
            _fail(f"stop[{i}] is empty; stop strings need at least 1 character")
        if len(s) > MAX_STOP_CHARS:
            _fail(f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")


def _check_stop_token_ids(ids: Any, vocab_size: int | None) -> None:
    if ids is None:
        return
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        _fail(f"stop_token_ids must be a list of token ids (integers), got {_short(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        _fail(f"stop_token_ids has {len(ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed")
    if vocab_size is not None:
        ordered = sorted(ids) if isinstance(ids, (set, frozenset)) else ids
        check_token_ids(ordered, f"{FIELD}stop_token_ids", vocab_size)


def _check_logit_bias(bias: Any, vocab_size: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        _fail(f"logit_bias must be an object of token id -> number, got {_short(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        _fail(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for key, value in bias.items():
        token = parse_token_key(key)
        if token is None or token < 0:
            _fail(f"logit_bias key {key!r} is not a token id (an integer >= 0)")
        elif vocab_size is not None and token >= vocab_size:
            _fail(_out_of_vocabulary(f"logit_bias key {key}", vocab_size))
        if not _FINITE.has_type(value):
            _fail(f"logit_bias[{key!r}] must be a finite number, got {value!r}")
