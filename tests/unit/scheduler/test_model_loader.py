"""resolve_model_path (GGUF conversion + cache), iterate_weights and default_weight_loader."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import save_file

from meshlm.scheduler.model_loader import (
    default_weight_loader,
    find_default_gguf,
    iterate_weights,
    resolve_model_path,
)


@pytest.fixture(scope="module")
def default_model_dir() -> Path:
    """The converted default model, in the default cache so repeated runs reuse it."""
    return resolve_model_path(None)


def test_default_gguf_is_bundled() -> None:
    path = find_default_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_default_model_converts_to_smollm2(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2
    assert config["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert (default_model_dir / "model.safetensors").is_file()


def test_second_resolve_is_cached(default_model_dir: Path) -> None:
    start = time.perf_counter()
    again = resolve_model_path(None)
    assert time.perf_counter() - start < 1.0
    assert again == default_model_dir


def test_converted_weights_are_float32_and_tied(default_model_dir: Path) -> None:
    names = {}
    for name, tensor in iterate_weights(default_model_dir, progress=False):
        names[name] = tensor
    assert "lm_head.weight" not in names
    embed = names["model.embed_tokens.weight"]
    assert embed.shape == (49152, 576) and embed.dtype == torch.float32
    assert len([n for n in names if n.startswith("model.layers.29.")]) == 9


def test_tokenizer_and_chat_template(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer("hello world")["input_ids"] == tokenizer.encode("hello world")


def test_model_dir_resolves_to_itself(default_model_dir: Path) -> None:
    assert resolve_model_path(str(default_model_dir)) == default_model_dir


@pytest.mark.parametrize("value", ["/no/such/model-dir", "{tmp}", "{tmp}/weights.txt"])
def test_bad_model_value_raises(tmp_path: Path, value: str) -> None:
    (tmp_path / "weights.txt").write_text("not a model")
    bad = value.format(tmp=tmp_path)
    with pytest.raises(ValueError, match="--model") as info:
        resolve_model_path(bad)
    assert bad in str(info.value)


def test_iterate_weights_sharded(tmp_path: Path) -> None:
    tensors = {
        "a.weight": torch.randn(4, 3),
        "b.weight": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "c.bias": torch.ones(5),
        "d.ids": torch.tensor([1, 2, 3], dtype=torch.int64),
    }
    shards = {
        "model-00001-of-00002.safetensors": ["a.weight", "c.bias"],
        "model-00002-of-00002.safetensors": ["b.weight", "d.ids"],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
        weight_map.update({k: shard for k in keys})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    got = dict(iterate_weights(tmp_path, progress=False))
    assert set(got) == set(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name], tensor)
    assert set(dict(iterate_weights(tmp_path, progress=True))) == set(tensors)


def test_iterate_weights_pytorch_bin_and_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        list(iterate_weights(tmp_path, progress=False))
    torch.save({"w": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin")
    got = dict(iterate_weights(tmp_path, progress=False))
    assert list(got) == ["w"] and torch.equal(got["w"], torch.zeros(2, 2))


def test_default_weight_loader_casts_and_checks_shape() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16), requires_grad=False)
    default_weight_loader(param, torch.full((2, 3), 1.5, dtype=torch.float32))
    assert param.dtype == torch.bfloat16 and bool((param == 1.5).all())
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight.*\(2, 3\).*\(3, 2\)"):
        default_weight_loader(param, torch.zeros(3, 2), name="layers.0.mlp.up_proj.weight")
