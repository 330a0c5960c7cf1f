"""Prompts and sampling shortcuts the engine feature tests share."""

from __future__ import annotations

from typing import Any

from meshlm.scheduler.engine import Engine

STORY = "Write a short story about a cat."


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def chat(engine: Engine, text: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return engine.apply_chat_template(msgs)
