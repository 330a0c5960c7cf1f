"""The scheduler's tokenizer, read without transformers.

The scheduler loop uses little of a tokenizer (managers/tokenizer_protocol.py: stop strings are
measured with `encode` and matched on `decode`d output tails; sessions look at `bos_token_id`
and at whether encoding a text adds it). `FastTokenizer` serves exactly that from tokenizer.json
with the `tokenizers` library, as the tokenizer and detokenizer services do (the prompt ids the
scheduler sees come from the same post-processor), in a fraction of a second; transformers'
AutoTokenizer costs seconds at start-up (importing transformers and its model configs). The
grammar backends (xgrammar, llguidance) and the in-process Engine (chat template, decode
options) need a transformers tokenizer: `hf_tokenizer()` loads it from the same directory at its
first call, once (the grammar backends are built on a compile thread at the first constrained
request, never at start-up).

Invariants: `decode` is transformers' `decode(ids)` (special tokens kept, the config's
clean_up_tokenization_spaces applied as transformers 5 does: not to a BPE vocabulary);
`encode(text, add_special_tokens)` is tokenizers' encode with padding and truncation off; a
directory without tokenizer.json (a slow-only tokenizer) gets the transformers tokenizer itself
from `load_tokenizer`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm.common.tokenizer_files import clean_up_tokenization, open_tokenizer_json, read_json_object, token_content


@dataclass(frozen=True)
class Encoding:
    """What calling a tokenizer on a text returns, as far as the scheduler looks (`input_ids`)."""

    input_ids: list[int]


class FastTokenizer:
    """tokenizer.json + tokenizer_config.json of one HF directory (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tok = open_tokenizer_json(self.path)
        config = read_json_object(self.path / "tokenizer_config.json")
        legacy = read_json_object(self.path / "special_tokens_map.json")  # fills what the config lacks
        bos = token_content(config.get("bos_token")) or token_content(legacy.get("bos_token"))
        self.bos_token_id: int | None = self._tok.token_to_id(bos) if bos else None
        # As transformers (>= 5): the cleanup is for WordPiece vocabularies and skipped for BPE,
        # which it would corrupt, unless the config insists.
        force = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE" or force
        )
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    def __call__(self, text: str) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def hf(self) -> Any:
        """The transformers tokenizer of this directory (loaded at the first call, thread-safe)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.path))
            return self._hf


def load_tokenizer(path: str | Path) -> Any:
    """A FastTokenizer of `path`, or the transformers tokenizer where there is no tokenizer.json."""
    if (Path(path) / "tokenizer.json").is_file():
        return FastTokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind `tokenizer` (itself unless it is a FastTokenizer)."""
    return tokenizer.hf() if isinstance(tokenizer, FastTokenizer) else tokenizer
