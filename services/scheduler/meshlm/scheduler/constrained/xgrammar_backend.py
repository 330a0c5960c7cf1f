"""The xgrammar backend (`--grammar-backend xgrammar`, the default; SGLang's
constrained/xgrammar_backend.py), from the PyPI package `xgrammar`.

The vocabulary is the model's tokenizer as xgrammar's TokenizerInfo, sized to the model's
vocab_size (ids past the tokenizer's are never allowed) with the model's EOS ids as the stop
tokens. json_schema compiles with compile_json_schema (JSON whitespace: JsonWhitespace), regex
with compile_regex, ebnf (GBNF, root rule `root`) with compile_grammar. xgrammar's compiler
caches by itself as well; it is thread-safe, so compiles run on the pool's threads.
"""

from __future__ import annotations

from typing import Any

import torch

from meshlm.scheduler.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from meshlm.scheduler.constrained.json_whitespace import JsonWhitespace


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self._compiled)

    def accept_token(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    def rollback(self, k: int) -> None:
        if k > 0:
            self._matcher.rollback(k)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(vocab_mask, row)


class XGrammarGrammarBackend(BaseGrammarBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], whitespace: JsonWhitespace, threads: int
    ) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads)
        self._whitespace = whitespace

    def dispatch_json(self, schema: str) -> BaseGrammarObject:
        ws = self._whitespace
        compiled = self._compiler.compile_json_schema(
            schema,
            any_whitespace=ws.any_whitespace,
            max_whitespace_cnt=ws.max_whitespace if ws.any_whitespace else None,
        )
        return XGrammarGrammar(compiled)

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        return XGrammarGrammar(self._compiler.compile_regex(regex))

    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject:
        return XGrammarGrammar(self._compiler.compile_grammar(ebnf))
