"""Model families and loading paths: tiny random Qwen2 (attention bias, untied head) and Llama
(untied head, sharded checkpoint) equal HF greedy decoding; SmolLM2 in bfloat16 equals HF's
bfloat16 generate; a .gguf file works as the model path. The tiny models (engine and HF) run on
MESHLM_TEST_DEVICE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshlm.scheduler.engine import Engine
from meshlm.scheduler.model_loader import find_default_gguf

from .conftest import TEST_DEVICE, assert_pools_whole

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "東京は日本の"]
NEW_TOKENS = 20


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with full recomputation (no generation config, EOS ignored)."""
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[-n:]


def build_tiny(kind: str, out_dir: Path, tokenizer, **config) -> torch.nn.Module:
    """A 2-layer random model with the SmolLM2 tokenizer, saved as an HF directory (`config`
    overrides the shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    common.update(config)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        for layer in model.model.layers:  # HF initialises biases to zero: make them matter
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
        model.save_pretrained(out_dir)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
        model.save_pretrained(out_dir, max_shard_size="200KB")
    tokenizer.save_pretrained(out_dir)
    return model.to(TEST_DEVICE).eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_tiny_random_model_matches_hf(kind: str, tmp_path: Path, tiny_tokenizer) -> None:
    model = build_tiny(kind, tmp_path, tiny_tokenizer)
    if kind == "llama":
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    prompts = [list(tiny_tokenizer(p).input_ids) for p in PROMPTS]
    expected = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    with Engine(
        dtype="float32", model_path=str(tmp_path), device=TEST_DEVICE, max_total_tokens=2048, load_progress=False
    ) as eng:
        ours = eng.scheduler.tp_worker.model_runner.model
        assert ours.lm_head is not ours.model.embed_tokens  # untied head loaded on its own
        sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        res = eng.generate_batch_sync([{"input_ids": ids, "sampling_params": sp} for ids in prompts])
        assert [r["output_ids"] for r in res] == expected
        assert_pools_whole(eng)


def test_bfloat16_matches_hf_bfloat16(smollm_path: str, smollm_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.bfloat16).eval()
    prompts = [list(smollm_tokenizer(p).input_ids) for p in PROMPTS]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=smollm_tokenizer.eos_token_id,
            )
        expected.append(gen[0, len(ids) :].tolist())
    with Engine(model_path=smollm_path, dtype="bfloat16", max_total_tokens=2048, load_progress=False) as eng:
        assert eng.scheduler.tp_worker.model_runner.dtype is torch.bfloat16
        assert next(eng.scheduler.tp_worker.model_runner.model.parameters()).dtype is torch.bfloat16
        sp = {"temperature": 0, "max_new_tokens": 8}
        res = eng.generate_batch_sync([{"input_ids": ids, "sampling_params": sp} for ids in prompts])
        assert [r["output_ids"] for r in res] == expected
        assert_pools_whole(eng)


def test_gguf_file_as_model_path(smollm_path: str, smollm_engine: Engine) -> None:
    gguf = find_default_gguf()
    ids = smollm_engine.tokenize("La capitale de la France est")
    sp = {"temperature": 0, "max_new_tokens": 12}
    expected = smollm_engine.generate_sync(input_ids=ids, sampling_params=sp)["output_ids"]
    with Engine(dtype="float32", model_path=str(gguf), max_total_tokens=2048, load_progress=False) as eng:
        assert Path(eng.config.model_path) == Path(smollm_path)
        assert eng.generate_sync(input_ids=ids, sampling_params=sp)["output_ids"] == expected
        assert_pools_whole(eng)
