"""Pythonic tool calls (Llama 3.2 / 4, ToolACE): one Python list of calls with keyword arguments,
`[get_weather(city="Paris"), add(a=1, b=2)]`. Argument values are Python literals (strings,
numbers, True/False/None, lists, dicts; JSON's true/false/null are taken too) and become a JSON
object. Text before the list is content; a list that is not only such calls stays content."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from meshlm.gateway.function_call.base import Item, ToolCall, ToolCallParser, held_back_pattern
from meshlm.gateway.function_call.json_scan import value_end

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_START_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = _name(func.value)
        return f"{base}.{func.attr}" if base else None
    return None


def parse_calls(source: str) -> list[ToolCall] | None:
    """The calls of a Python list source, or None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _name(node.func)
        if name is None or any(kw.arg is None for kw in node.keywords):
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            text = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):
            return None
        calls.append(ToolCall(name, text))
    return calls


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def step(self, pending: str, final: bool) -> tuple[list[Item], int]:
        found = _START.search(pending)
        if found is None:
            keep = len(pending) if final else held_back_pattern(pending, _START_PREFIX)
            return [pending[:keep]], keep
        if found.start() > 0:
            return [pending[: found.start()]], found.start()
        end = value_end(pending, 0, quotes="\"'")
        if end is None:
            return ([pending], len(pending)) if final else ([], 0)
        calls = parse_calls(pending[:end])
        return (list(calls), end) if calls else ([pending[:end]], end)
