"""The tool-call parsers by the name `--tool-call-parser` takes (vLLM's / SGLang's names)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from meshlm.gateway.function_call.base import ToolCallParser
from meshlm.gateway.function_call.hermes import HermesParser, Qwen25Parser
from meshlm.gateway.function_call.llama3_json import Llama3JsonParser
from meshlm.gateway.function_call.mistral import MistralParser
from meshlm.gateway.function_call.pythonic import PythonicParser

PARSERS: Mapping[str, Callable[[], ToolCallParser]] = MappingProxyType(
    {
        "hermes": HermesParser,
        "qwen25": Qwen25Parser,
        "qwen": Qwen25Parser,
        "llama3_json": Llama3JsonParser,
        "llama3": Llama3JsonParser,
        "mistral": MistralParser,
        "pythonic": PythonicParser,
    }
)


def new_parser(name: str) -> ToolCallParser:
    """A fresh parser (parsers keep per-request state)."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
