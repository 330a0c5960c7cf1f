"""JsonWhitespace: what whitespace a json_schema grammar allows between JSON tokens.

SGLang allows any whitespace by default (`--constrained-json-disable-any-whitespace` turns it
off). A small model under a JSON grammar can fall into emitting newline after newline, which
the grammar allows forever and only max_new_tokens ends, truncating the JSON. So meshlm bounds
each run: at most `max_whitespace` whitespace characters between two JSON tokens
(`--constrained-json-max-whitespace`, default 2); with any_whitespace off, the output is compact
JSON (xgrammar: ", " and ": " separators; llguidance: "," and ":").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JsonWhitespace:
    any_whitespace: bool = True
    max_whitespace: int = 2  # >= 1; the longest whitespace run between JSON tokens

    def __post_init__(self) -> None:
        if self.max_whitespace < 1:
            raise ValueError(f"constrained_json_max_whitespace must be >= 1, got {self.max_whitespace}")

    def llguidance_pattern(self) -> str | None:
        """llguidance's whitespace_pattern (None: no whitespace at all)."""
        return f"[\\x20\\x0A\\x0D\\x09]{{0,{self.max_whitespace}}}" if self.any_whitespace else None
