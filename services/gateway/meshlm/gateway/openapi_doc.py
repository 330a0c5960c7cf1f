"""The OpenAPI document (/openapi.json) as the routes really validate: FastAPI's document of the
pydantic models (whose bounds come from meshlm.gateway.input_types), plus the two constraints a
model cannot state, known once the gateway has the model info (the first tokenizer call; the
name also from --served-model-name): every request body's `model` field is the served model's
name (an enum; any other is a 404), and every token id is below the vocabulary size (a larger
one is a 400 from the tokenizer). Before that both stay as the models state them.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI

from meshlm.gateway.input_types import TOKEN_ID_DESCRIPTION
from meshlm.gateway.state import GatewayState


def _request_schemas(doc: dict[str, Any]) -> set[str]:
    """Names of the component schemas that are some operation's JSON request body."""
    names = set()
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            body = operation.get("requestBody", {}) if isinstance(operation, dict) else {}
            ref = body.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
            if ref.startswith("#/components/schemas/"):
                names.add(ref.rsplit("/", 1)[1])
    return names


def with_model_enum(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of `doc` whose request bodies' string `model` fields are the enum [name]."""
    out = copy.deepcopy(doc)
    schemas = out.get("components", {}).get("schemas", {})
    for schema_name in _request_schemas(out):
        model = schemas.get(schema_name, {}).get("properties", {}).get("model")
        if model is None:
            continue
        for branch in model.get("anyOf", [model]):
            if branch.get("type") == "string":
                branch["enum"] = [name]
    return out


def with_vocabulary(doc: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """`doc` (changed in place) with every token id's maximum the last id of the vocabulary."""
    stack: list[Any] = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("description") == TOKEN_ID_DESCRIPTION and item.get("type") == "integer":
                item["maximum"] = vocab_size - 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return doc


def install_openapi(app: FastAPI, state: GatewayState) -> None:
    """Serve `with_model_enum` of FastAPI's document once the served model name is known."""
    generate = app.openapi  # FastAPI's: builds the document once and caches it

    def openapi() -> dict[str, Any]:
        doc = generate()
        name = state.config.served_model_name
        info = state.cached_model_info()
        if name is None and info is not None:
            name = info.served_model_name or info.model_path
        if not name:
            return doc
        doc = with_model_enum(doc, name)
        return with_vocabulary(doc, info.vocab_size) if info is not None and info.vocab_size > 0 else doc

    app.openapi = openapi  # type: ignore[method-assign]
