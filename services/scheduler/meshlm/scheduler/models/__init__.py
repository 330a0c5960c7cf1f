"""Model registry: HF `architectures[0]` -> our implementation (imported lazily)."""

from __future__ import annotations

import importlib

__all__ = ["get_model_class", "ARCHITECTURES"]

ARCHITECTURES = {
    "LlamaForCausalLM": ("meshlm.scheduler.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("meshlm.scheduler.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("meshlm.scheduler.models.qwen2", "Qwen2ForCausalLM"),
    "BertModel": ("meshlm.scheduler.models.bert", "BertModel"),
    "BertForMaskedLM": ("meshlm.scheduler.models.bert", "BertModel"),
}


def get_model_class(architecture: str) -> type:
    """Return the class for an HF architecture name; ValueError names the supported ones."""
    try:
        module, name = ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        ) from None
    return getattr(importlib.import_module(module), name)
