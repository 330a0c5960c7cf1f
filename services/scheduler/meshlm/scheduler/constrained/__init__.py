"""Constrained decoding (SGLang's constrained/): grammar backends, the compile pool and cache,
and the token bitmask the sampler applies.

    base_grammar_backend.py  BaseGrammarBackend / BaseGrammarObject: compile a key, a matcher
                             per request (bitmask, accept, rollback, is_terminated)
    xgrammar_backend.py      --grammar-backend xgrammar (default)
    llguidance_backend.py    --grammar-backend llguidance
    json_whitespace.py       the whitespace a JSON grammar allows
    compile_pool.py          GrammarCompilePool: compile threads + cache by (kind, text)
    vocab_mask.py            the int32 bitmask and its application to logits
    backends.py              create_grammar_backend: the backend a flag names

The loop side (the grammar queue) is managers/grammar_manager.py.
"""

from meshlm.scheduler.constrained.base_grammar_backend import (
    FIELD_OF_KIND,
    KINDS,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarKey,
    InvalidGrammarError,
)
from meshlm.scheduler.constrained.compile_pool import GrammarCompilePool
from meshlm.scheduler.constrained.json_whitespace import JsonWhitespace

__all__ = [
    "FIELD_OF_KIND",
    "KINDS",
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "GrammarCompilePool",
    "GrammarKey",
    "InvalidGrammarError",
    "JsonWhitespace",
]
