"""The reasoning styles by the name `--reasoning-parser` takes (SGLang's names)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from meshlm.gateway.reasoning.parser import ReasoningStyle

STYLES: Mapping[str, ReasoningStyle] = MappingProxyType(
    {
        # DeepSeek-R1's template ends the prompt with "<think>\n": the output starts thinking.
        "deepseek-r1": ReasoningStyle("deepseek-r1", starts_in_reasoning=True),
        # Qwen3 thinks only when its output opens <think> (enable_thinking=false: it does not).
        "qwen3": ReasoningStyle("qwen3"),
    }
)


def style_of(name: str) -> ReasoningStyle:
    try:
        return STYLES[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(STYLES))}") from None
