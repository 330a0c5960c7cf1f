"""Request fields meshlm does not support: never dropped without a word.

The OpenAI request models keep unknown fields (extra="allow"); `unsupported_fields` lists them
by path (`logit_bias_x`, `messages[2].audio`), and `report_unsupported` logs them in one warning
per request, or rejects the request with a 400 naming them when the gateway runs with
--strict-api."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from meshlm.gateway.errors import bad_request

logger = logging.getLogger(__name__)


def _walk(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unsupported_fields(value, path + ".")
    if isinstance(value, list):
        return [name for i, item in enumerate(value) for name in _walk(item, f"{path}[{i}]")]
    return []


def unsupported_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The paths of every field of `model` (nested models included) that no model declares."""
    names = [prefix + key for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        names += _walk(getattr(model, name), prefix + name)
    return names


def report_unsupported(body: BaseModel, strict: bool, rid: str) -> None:
    """Log the request's unsupported fields once, or (strict) refuse the request naming them."""
    names = unsupported_fields(body)
    if not names:
        return
    if strict:
        raise bad_request(f"unsupported request fields (--strict-api): {', '.join(names)}", names[0])
    logger.warning("request %s: ignoring unsupported fields: %s", rid, ", ".join(names))
