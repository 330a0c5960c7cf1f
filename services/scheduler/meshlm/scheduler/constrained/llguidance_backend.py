"""The llguidance backend (`--grammar-backend llguidance`; SGLang's
constrained/llguidance_backend.py), from the PyPI package `llguidance`.

The vocabulary is the model's Hugging Face tokenizer as an LLTokenizer of the model's
vocab_size with the model's EOS ids. json_schema becomes a grammar with
LLMatcher.grammar_from_json_schema (JSON whitespace: JsonWhitespace), regex with
grammar_from_regex, ebnf (GBNF or Lark) through llguidance's GBNF -> Lark conversion. A
compile validates the grammar against the tokenizer and builds one pristine LLMatcher; each
request gets a deep copy of it.
"""

from __future__ import annotations

from typing import Any

import torch

from meshlm.scheduler.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    InvalidGrammarError,
)
from meshlm.scheduler.constrained.json_whitespace import JsonWhitespace


class GuidanceGrammar(BaseGrammarObject):
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def copy(self) -> GuidanceGrammar:
        return GuidanceGrammar(self._matcher.deep_copy())

    def accept_token(self, token: int) -> bool:
        # A rejected token would leave an LLMatcher in its error state for good: check first.
        if self._matcher.validate_tokens([token]) != 1:
            return False
        return bool(self._matcher.consume_token(token))

    def rollback(self, k: int) -> None:
        if k > 0 and not self._matcher.rollback(k):
            raise RuntimeError(f"llguidance could not roll back {k} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        dst = vocab_mask[row]
        assert dst.is_contiguous() and dst.dtype == torch.int32 and dst.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(dst.data_ptr(), dst.numel() * dst.element_size())


class GuidanceBackend(BaseGrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], whitespace: JsonWhitespace) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        eos = list(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._json_options: dict[str, Any] = (
            {"whitespace_flexible": True, "whitespace_pattern": whitespace.llguidance_pattern()}
            if whitespace.any_whitespace
            else {"whitespace_flexible": False}
        )

    def _matcher(self, grammar: str, field: str) -> BaseGrammarObject:
        matcher = self._ll.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammarError(f"sampling_params.{field} cannot be compiled (llguidance): {matcher.get_error()}")
        return GuidanceGrammar(matcher)

    def dispatch_json(self, schema: str) -> BaseGrammarObject:
        grammar = self._ll.LLMatcher.grammar_from_json_schema(schema, defaults=self._json_options)  # type: ignore[arg-type]
        return self._matcher(grammar, "json_schema")

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        return self._matcher(self._ll.LLMatcher.grammar_from_regex(regex), "regex")

    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject:
        from llguidance.gbnf_to_lark import any_to_lark

        return self._matcher(self._ll.LLMatcher.grammar_from_lark(any_to_lark(ebnf)), "ebnf")
