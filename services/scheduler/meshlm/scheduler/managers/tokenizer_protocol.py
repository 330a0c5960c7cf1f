"""Tokenizer: what the scheduler loop uses of a Hugging Face tokenizer (stop strings are
measured with `encode` and matched on `decode`d output tails; sessions look at `bos_token_id`
and at what calling it on a text returns). The loop runs without one (tokenizer None) too:
stop strings are then measured in characters and never matched."""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None

    def __call__(self, text: str) -> Any:
        """A BatchEncoding: `.input_ids` holds the ids, with any special tokens added."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any:
        """The ids of text: a list, or an object with `.ids`."""

    def decode(self, token_ids: list[int]) -> str: ...
