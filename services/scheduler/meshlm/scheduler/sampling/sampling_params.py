"""SamplingParams: per-request decoding controls, with SGLang's defaults and validation.

Life cycle: build with ``SamplingParams(...)`` or ``from_dict``, then ``verify(vocab_size)``
(the rules of meshlm.common.sampling_rules, shared with the tokenizer: raises ``ValueError``
naming the field, the allowed range and the given value), then
``normalize(tokenizer)``. After ``normalize``:

- ``stop_strs`` is a list of strings and ``stop_str_max_len`` the longest stop string in
  tokens (characters when there is no tokenizer);
- a temperature below 1e-6 has become greedy: ``top_k == 1`` and ``temperature == 1.0``;
- ``top_k == -1`` has become ``TOP_K_ALL``, so ``top_k >= 1`` always holds.

``normalize`` is idempotent, and ``verify`` accepts both the raw and the normalized form.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from meshlm.common.sampling_rules import DEFAULT_MAX_NEW_TOKENS, RANGES, check_sampling_params

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


@dataclass
class SamplingParams:
    """Sampling parameters of one request (SGLang's field names and defaults).

    None for a field that is not Optional falls back to its default; ``max_new_tokens=None``
    means "up to the context length" (the scheduler caps it).
    """

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    custom_params: dict[str, Any] | None = None

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
        """Raise ValueError (meshlm.common.sampling_rules.InvalidArgument) naming the first
        invalid field, its allowed values and its value: the rules the tokenizer applies too,
        plus the vocabulary checks (stop_token_ids, logit_bias keys in [0, vocab_size))."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        check_sampling_params(values, vocab_size)

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

        t = self.temperature
        if RANGES["temperature"].has_type(t) and 0 <= t < SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with integer keys (assumes verify() passed); empty when unset."""
        if not self.logit_bias:
            return {}
        return {int(k): float(v) for k, v in self.logit_bias.items()}
