"""Where a JSON (or Python-literal) value ends in a text that may still be growing."""

from __future__ import annotations

_CLOSE = {"[": "]", "{": "}", "(": ")"}


def value_end(text: str, start: int, quotes: str = '"') -> int | None:
    """The index just past the bracketed value (`[...]`, `{...}` or `(...)`) that opens at
    text[start], honouring strings in `quotes` and their backslash escapes; None if the text
    ends first. Brackets are matched by kind only as far as nesting depth: a mismatched closer
    ends the value early and the caller's parse rejects it."""
    if start >= len(text) or text[start] not in _CLOSE:
        raise ValueError("a value must open with [, { or (")
    depth = 0
    quote = ""
    i = start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in quotes:
            quote = ch
        elif ch in _CLOSE:
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
