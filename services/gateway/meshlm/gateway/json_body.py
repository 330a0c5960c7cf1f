"""The JSON body of every REST route, decoded strictly: `StrictJsonRoute`, the routers' APIRoute.

Python's json module accepts more than JSON (RFC 8259) and more than protobuf can carry:
* `NaN`, `Infinity`, `-Infinity` literals: rejected (JSON has no such numbers);
* a lone UTF-16 surrogate escape (`"\\ud800"`): decoded as a str that cannot be encoded as
  UTF-8, so a protobuf string field (or the tokenizer) would raise; rejected, naming the field;
* invalid UTF-8 bytes, an integer of more digits than Python parses, nesting deeper than the
  decoder's recursion: rejected with the decoder's reason.
Each is a 400 in OpenAI's error shape; syntax errors stay FastAPI's ("Invalid JSON body ... (at
position N)", errors.py). Invariant: every str a route's model receives is valid Unicode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from meshlm.gateway.errors import error_response

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only these escapes can decode to a lone surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadBody(HTTPException):
    """A body that is not strict JSON. A starlette HTTPException, so FastAPI's body parsing lets it
    through to StrictJsonRoute (it turns any other exception into a bare 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.message = message
        self.param = param


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(path, description) of the first string (or object key) holding a lone surrogate, else None."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return _path(where) or "body", f"character {found.start()} is U+{ord(found.group()):04X}"
        elif isinstance(item, dict):
            for key, sub in item.items():
                found = _SURROGATE.search(key)
                if found:
                    return _path(where) or "body", f"a key holds U+{ord(found.group()):04X}"
                stack.append(((*where, key), sub))
        elif isinstance(item, list):
            stack.extend(((*where, i), sub) for i, sub in enumerate(item))
    return None


def decode_json(body: bytes) -> Any:
    """The decoded body, or BadBody; json.JSONDecodeError (a syntax error) passes through."""
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as e:  # bad UTF-8, a NaN literal, a huge integer, deep nesting
        raise BadBody(f"Invalid JSON body: {e}") from None
    if _SURROGATE_ESCAPE.search(body):
        found = lone_surrogate(value)
        if found is not None:
            where, what = found
            raise BadBody(
                f"{where}: invalid Unicode: {what}, a lone UTF-16 surrogate (escape pairs must form one character)",
                where.split(".")[0].split("[")[0],
            )
    return value


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """An APIRoute whose request body is decoded by decode_json; BadBody becomes its 400."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            try:
                return await handler(StrictJsonRequest(request.scope, request.receive))
            except BadBody as e:
                return error_response(400, e.message, param=e.param)

        return strict
