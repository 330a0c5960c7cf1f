"""SamplingParams: per-request decoding controls, with SGLang's defaults and validation.

Life cycle: build with ``SamplingParams(...)`` or ``from_dict``, then ``verify(vocab_size)``
(raises ``ValueError`` naming the field, the allowed range and the given value), then
``normalize(tokenizer)``. After ``normalize``:

- ``stop_strs`` is a list of strings and ``stop_str_max_len`` the longest stop string in
  tokens (characters when there is no tokenizer);
- a temperature below 1e-6 has become greedy: ``top_k == 1`` and ``temperature == 1.0``;
- ``top_k == -1`` has become ``TOP_K_ALL``, so ``top_k >= 1`` always holds.

``normalize`` is idempotent, and ``verify`` accepts both the raw and the normalized form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

__all__ = ["SamplingParams", "TOP_K_ALL", "SAMPLING_EPS"]

TOP_K_ALL = 1 << 30  # top_k meaning "the whole vocabulary"
SAMPLING_EPS = 1e-6  # temperatures below this are greedy

# Fields whose None means "use the default" (the others keep None as a meaningful value).
_NON_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
}

_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)
_UNSUPPORTED_FIELDS = ("json_schema", "regex", "ebnf")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_real(name: str, value: Any, ok: bool, expected: str) -> None:
    """Raise unless ok (the caller's type and range test on value) holds."""
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


@dataclass
class SamplingParams:
    """Sampling parameters of one request (SGLang's field names and defaults).

    None for a field that is not Optional falls back to its default; ``max_new_tokens=None``
    means "up to the context length" (the scheduler caps it).
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: Optional[dict[str, float]] = None
    sampling_seed: Optional[int] = None
    stream_interval: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    custom_params: Optional[dict[str, Any]] = None

    # Derived by normalize(); not accepted by from_dict.
    stop_strs: list[str] = field(default_factory=list, init=False)
    stop_str_max_len: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for name, default in _NON_OPTIONAL_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys raise ValueError, None values are defaults."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls) if f.init}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token (top_k == 1)."""
        return self.top_k == 1

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError naming the first invalid field, its allowed range and its value."""
        self._verify_numbers()
        self._verify_lengths()
        self._verify_stops(vocab_size)
        self._verify_logit_bias(vocab_size)
        self._verify_misc()

    def _verify_numbers(self) -> None:
        t = self.temperature
        _check_real("temperature", t, _is_real(t) and math.isfinite(t) and t >= 0,
                    "a finite number >= 0")
        p = self.top_p
        _check_real("top_p", p, _is_real(p) and 0 < p <= 1, "a number in (0, 1]")
        k = self.top_k
        if not _is_int(k) or not (k == -1 or k >= 1):
            raise ValueError(f"top_k must be -1 (whole vocabulary) or an integer >= 1, got {k!r}")
        m = self.min_p
        _check_real("min_p", m, _is_real(m) and 0 <= m <= 1, "a number in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            _check_real(name, v, _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]")
        r = self.repetition_penalty
        _check_real("repetition_penalty", r, _is_real(r) and 0 < r <= 2, "a number in (0, 2]")

    def _verify_lengths(self) -> None:
        mx, mn = self.max_new_tokens, self.min_new_tokens
        if mx is not None and (not _is_int(mx) or mx < 0):
            raise ValueError(f"max_new_tokens must be an integer >= 0 or None, got {mx!r}")
        if not _is_int(mn) or mn < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {mn!r}")
        if mx is not None and mn > mx:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={mx}], got {mn!r}"
            )
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        si = self.stream_interval
        if si is not None and (not _is_int(si) or si < 1):
            raise ValueError(f"stream_interval must be an integer >= 1 or None, got {si!r}")

    def _verify_stops(self, vocab_size: int) -> None:
        s = self.stop
        if s is not None and not isinstance(s, str):
            if not isinstance(s, (list, tuple)) or not all(isinstance(x, str) for x in s):
                raise ValueError(f"stop must be a string, a list of strings or None, got {s!r}")
        ids = self.stop_token_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids or None, got {ids!r}")
        for t in ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"stop_token_ids must hold token ids in [0, {vocab_size}), got {t!r}"
                )

    def _verify_logit_bias(self, vocab_size: int) -> None:
        lb = self.logit_bias
        if lb is None:
            return
        if not isinstance(lb, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> number, got {lb!r}")
        for key, value in lb.items():
            token = _parse_token_key(key)
            if token is None or not 0 <= token < vocab_size:
                raise ValueError(
                    f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}"
                )
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(
                    f"logit_bias values must be finite numbers, got {value!r} for token {key!r}"
                )

    def _verify_misc(self) -> None:
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")
        seed = self.sampling_seed
        if seed is not None and not _is_int(seed):
            raise ValueError(f"sampling_seed must be an integer or None, got {seed!r}")
        cp = self.custom_params
        if cp is not None and not isinstance(cp, dict):
            raise ValueError(f"custom_params must be a dict or None, got {cp!r}")
        for name in _UNSUPPORTED_FIELDS:
            v = getattr(self, name)
            if v is not None:
                raise ValueError(
                    f"{name} is not supported (structured output is not implemented), "
                    f"got {v!r}"
                )

    def normalize(self, tokenizer: Any) -> None:
        """Derive stop_strs / stop_str_max_len and canonicalize greedy and top_k (idempotent).

        ``tokenizer.encode(s, add_special_tokens=False)`` may return a list of ids or an
        object with ``.ids`` (a ``tokenizers.Encoding``); None measures stop strings in chars.
        """
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        max_len = 0
        for s in self.stop_strs:
            if tokenizer is None:
                n = len(s)
            else:
                ids = tokenizer.encode(s, add_special_tokens=False)
                n = len(getattr(ids, "ids", ids))
            max_len = max(max_len, n)
        self.stop_str_max_len = max_len

        if _is_real(self.temperature) and 0 <= self.temperature < SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with integer keys (assumes verify() passed); empty when unset."""
        if not self.logit_bias:
            return {}
        return {int(k): float(v) for k, v in self.logit_bias.items()}


def _parse_token_key(key: Any) -> Optional[int]:
    """A logit_bias key as an int, or None when it is not an integer or integer string."""
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            return None
    return None
