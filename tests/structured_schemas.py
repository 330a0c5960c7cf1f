"""The JSON schemas, regexes and EBNF grammars the structured-output tests constrain the default
model with (engine and end-to-end tests share them).

Every schema bounds its output (maxLength / maxItems / enum / pattern / integer ranges) and every
object is closed (additionalProperties false), so a constrained output is short and must end
with the grammar: a finish by length is a failure, never a case to tolerate."""

from __future__ import annotations

import copy
import json
from typing import Any

SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that does not say."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person",
        obj({"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    ),
    ("a color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    (
        "a few digits",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    ),
    (
        "a user with an email",
        obj(
            {
                "user": obj(
                    {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,6}\\.com$"},
                    }
                )
            }
        ),
    ),
    ("a yes/no flag", obj({"ok": {"type": "boolean"}})),
    ("a product code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    ("a price", obj({"price": {"type": "number", "minimum": 0, "maximum": 100}})),
    (
        "key/value pairs",
        {
            "type": "array",
            "items": obj({"k": {"type": "string", "maxLength": 5}, "v": SMALL_INT}),
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    ("a versioned name", obj({"version": {"const": "1.0"}, "name": {"type": "string", "maxLength": 8}})),
    ("a count or a word", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"enum": ["none", "many"]}]}),
    ("a middle name or null", obj({"middle": {"type": ["string", "null"], "maxLength": 6}})),
    (
        "a point",
        obj(
            {
                "point": obj(
                    {
                        "x": {"type": "integer", "minimum": -10, "maximum": 10},
                        "y": {"type": "integer", "minimum": -10, "maximum": 10},
                    }
                )
            }
        ),
    ),
    ("a level", obj({"level": {"type": "integer", "enum": [1, 2, 3]}})),
    ("some pets", {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3}),
    ("a nested flag", obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})})),
    (
        "a film",
        obj(
            {
                "title": {"type": "string", "maxLength": 15},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                "genre": {"enum": ["drama", "comedy"]},
            },
            required=["title", "year"],
        ),
    ),
    ("a date", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("a short word", {"type": "string", "minLength": 2, "maxLength": 6}),
    ("a two-digit number", {"type": "integer", "minimum": 10, "maximum": 99}),
    (
        "a ticket",
        obj({"status": {"enum": ["open", "closed"]}, "ids": {"type": "array", "items": SMALL_INT, "maxItems": 3}}),
    ),
]
SCHEMAS = [(what, _closed(s)) for what, s in SCHEMAS]
assert len(SCHEMAS) == 20

REGEXES = [r"(yes|no), [0-9]{3}", r"[A-Z][a-z]{2,8} [0-9]{1,2}(st|nd|rd|th)", r"#[0-9a-f]{6}"]
# GBNF (xgrammar's EBNF dialect; llguidance converts it to Lark).
EBNF = 'root ::= "The answer is " color "." \ncolor ::= "red" | "green" | "blue"'
EBNF_TEXTS = {f"The answer is {c}." for c in ("red", "green", "blue")}
MAX_NEW_TOKENS = 200  # far above what any bounded output above needs


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(copy.deepcopy(schema))


def prompt_for(what: str) -> str:
    return f"Reply with JSON only: {what}."
