"""The grammar interface of constrained decoding (SGLang's constrained/base_grammar_backend.py).

A request's constraint is a GrammarKey: (kind, text) with kind one of KINDS, taken from the
sampling params json_schema / regex / ebnf. A BaseGrammarBackend compiles a key into a
BaseGrammarObject once (`compile`, on a compile thread: see GrammarCompilePool); the compiled
object is a pristine template that is never advanced, and each request gets its own matcher
from it with `copy()` (n>1 sequences and retried requests each have theirs).

A matcher per request:

    fill_vocab_mask(mask, row)   write the allowed next tokens into row `row` of an int32
                                 bitmask [rows, ceil(vocab/32)] (bit t%32 of word t//32 set =
                                 token t allowed; vocab_mask.allocate_vocab_mask)
    accept_token(t) -> bool      advance by the sampled token; False = t breaks the grammar
                                 (the matcher is then unchanged)
    rollback(k)                  undo the last k accepted tokens
    is_terminated()              the grammar ended (it accepted one of its stop tokens): the
                                 request finishes with finish reason stop

Invariant kept by the scheduler: a request's matcher has accepted exactly its output_ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

KINDS = ("json", "regex", "ebnf")
# The sampling parameter each kind comes from (errors name it).
FIELD_OF_KIND = {"json": "json_schema", "regex": "regex", "ebnf": "ebnf"}
GrammarKey = tuple[str, str]  # (kind, text)


class InvalidGrammarError(ValueError):
    """A schema / regex / grammar the backend cannot compile; the message names the field."""


class BaseGrammarObject(ABC):
    """One request's grammar matcher (or, in the compile cache, the template it is copied from)."""

    @abstractmethod
    def copy(self) -> BaseGrammarObject:
        """A fresh matcher at the grammar's start (the template itself is never advanced)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last k accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar accepted its end (a stop token)."""

    @abstractmethod
    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of the int32 CPU bitmask."""


class BaseGrammarBackend(ABC):
    """Compiles grammar keys for one vocabulary. `compile` runs on compile threads (it must be
    thread-safe); it raises InvalidGrammarError for input the backend rejects."""

    name: str

    def compile(self, key: GrammarKey) -> BaseGrammarObject:
        kind, text = key
        field = f"sampling_params.{FIELD_OF_KIND.get(kind, kind)}"
        try:
            if kind == "json":
                return self.dispatch_json(text)
            if kind == "regex":
                return self.dispatch_regex(text)
            if kind == "ebnf":
                return self.dispatch_ebnf(text)
        except InvalidGrammarError:
            raise
        except Exception as e:  # the native compilers raise RuntimeError / ValueError
            raise InvalidGrammarError(f"{field} cannot be compiled ({self.name}): {_first_line(e)}") from None
        raise InvalidGrammarError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")

    @abstractmethod
    def dispatch_json(self, schema: str) -> BaseGrammarObject: ...

    @abstractmethod
    def dispatch_regex(self, regex: str) -> BaseGrammarObject: ...

    @abstractmethod
    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject: ...


def _first_line(e: BaseException) -> str:
    """The native compilers' messages carry a source location prefix and a trailing newline."""
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    # xgrammar: "[14:34:58] /project/cpp/regex_converter.cc:94: Regex parsing error at ..."
    if line.startswith("[") and ": " in line:
        parts = line.split(": ", 1)
        if ".cc:" in parts[0] or ".h:" in parts[0]:
            line = parts[1]
    return line
