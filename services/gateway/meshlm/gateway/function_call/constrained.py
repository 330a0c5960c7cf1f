"""tool_choice `required` and named as constrained decoding: the JSON schema the output must
follow (sent as the request's json_schema), so that any model returns parseable calls whose
arguments validate against the function's parameters (vLLM's construction)."""

from __future__ import annotations

from typing import Any

# A function without `parameters` takes an object of anything (OpenAI's reading).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else ANY_OBJECT


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The output is the named function's arguments."""
    return parameters_of(tool)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The output is a non-empty list of {"name": one of the functions, "parameters": its
    arguments}; one item only when parallel_tool_calls is false."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters_of(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
