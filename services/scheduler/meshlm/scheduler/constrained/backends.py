"""create_grammar_backend: the backend `--grammar-backend` names, over the model's tokenizer.

GRAMMAR_BACKENDS lists the choices; "none" has no backend (constrained requests are refused).
The packages are imported only here, when a backend is built (on a compile thread)."""

from __future__ import annotations

from typing import Any

from meshlm.scheduler.config import GRAMMAR_BACKENDS
from meshlm.scheduler.constrained.base_grammar_backend import BaseGrammarBackend
from meshlm.scheduler.constrained.json_whitespace import JsonWhitespace


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], whitespace: JsonWhitespace, threads: int = 2
) -> BaseGrammarBackend:
    """tokenizer: the model's Hugging Face (fast) tokenizer; vocab_size: the model's (logits
    width); eos_token_ids: the model's EOS ids, the grammars' stop tokens."""
    if name == "xgrammar":
        from meshlm.scheduler.constrained.xgrammar_backend import XGrammarGrammarBackend

        return XGrammarGrammarBackend(tokenizer, vocab_size, eos_token_ids, whitespace, threads)
    if name == "llguidance":
        from meshlm.scheduler.constrained.llguidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids, whitespace)
    raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS[:2]} to build a backend, got {name!r}")
