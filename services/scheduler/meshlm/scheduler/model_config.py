"""ModelConfig: the facts about a model that the engine needs, read from an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a --dtype string to a torch dtype; raise ValueError naming the allowed values."""
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {name!r}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts. `hf` keeps the raw config dict for model-specific fields."""

    path: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_len: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    is_embedding: bool
    eos_token_ids: tuple[int, ...]
    hf: dict[str, Any]

    @property
    def served_name(self) -> str:
        """A short model name for APIs: the GGUF's stem (up to its quantization suffix) for a
        converted GGUF, else the directory name."""
        marker = Path(self.path) / "meshlm_conversion.json"
        if marker.exists():
            source = json.loads(marker.read_text()).get("source")
            if source:
                return Path(source).name.split(".")[0]
        return Path(self.path).name

    def verify_tp_size(self, tp_size: int) -> None:
        """Raise ValueError naming tp_size and the model field it cannot shard.

        What the TP layers support: attention heads and the MLP's intermediate size split
        evenly; KV heads split evenly or, with fewer KV heads than ranks, each is replicated
        on tp_size / num_key_value_heads ranks; the vocabulary is padded to a multiple of
        tp_size. Embedding models (BERT) run on one rank only.
        """
        if tp_size == 1:
            return
        if self.is_embedding:
            raise ValueError(f"tp_size must be 1 for embedding models ({self.architecture}), got {tp_size}")
        kv = self.num_key_value_heads
        if self.num_attention_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide num_attention_heads ({self.num_attention_heads})")
        if kv % tp_size and tp_size % kv:
            raise ValueError(f"tp_size {tp_size} must divide num_key_value_heads ({kv}) or be a multiple of it")
        if self.intermediate_size % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide intermediate_size ({self.intermediate_size})")

    @staticmethod
    def from_path(path: str | Path, context_length: int | None = None) -> ModelConfig:
        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        is_bert = hf.get("model_type") == "bert" or arch.startswith("Bert")
        ctx = int(hf.get("max_position_embeddings") or hf.get("n_positions") or hf.get("seq_length") or 2048)
        if context_length is not None:
            ctx = context_length
        eos = hf.get("eos_token_id")
        gen_cfg = path / "generation_config.json"
        if gen_cfg.exists():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            path=str(path),
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf.get("intermediate_size", 4 * hidden)),
            vocab_size=int(hf["vocab_size"]),
            context_len=ctx,
            rms_norm_eps=float(hf.get("rms_norm_eps", hf.get("layer_norm_eps", 1e-6))),
            # transformers >= 5 nests RoPE settings under rope_parameters.
            rope_theta=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch.startswith("Qwen2"))),
            is_embedding=is_bert,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            hf=hf,
        )
