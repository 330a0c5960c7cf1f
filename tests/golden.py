"""Golden prompts and the HF transformers reference they are checked against (engine and
end-to-end tests share them; the fixtures live in tests/conftest.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

GOLDEN_NEW_TOKENS = 32
# Where the HF references and the tiny-model engines run: cpu (default) or cuda
# (bench/gpu_check.sh). SmolLM2 engines keep the engine's own default device (auto).
TEST_DEVICE = os.environ.get("MESHLM_TEST_DEVICE", "cpu")

# Engine overrides under which greedy outputs must stay token-identical (pytest ids alongside).
SCHEDULING_CONFIGS = {
    "no-radix": {"disable_radix_cache": True},
    "chunk16": {"chunked_prefill_size": 16},
    "page16": {"page_size": 16},
    "page16-chunk32": {"page_size": 16, "chunked_prefill_size": 32},
    "lpm": {"schedule_policy": "lpm"},
    "mixed-chunk16": {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    "mixed-page16-chunk32": {"enable_mixed_chunk": True, "page_size": 16, "chunked_prefill_size": 32},
}

RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "La capitale de la France est",
    "東京は日本の",
    "Once upon a time, in a land far away, there lived a",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explique la photosynthèse en une phrase.",
    "List three prime numbers.",
]


@dataclass(frozen=True)
class Golden:
    input_ids: list[int]
    output_ids: list[int]  # HF greedy continuation (up to and including EOS, if reached)
    logprobs: list[float]  # log_softmax of HF's logits at each generated token
    margins: list[float] = field(default_factory=list)  # HF's top-1 minus top-2 logit per step


def chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def compute_golden(model, tokenizer) -> list[Golden]:
    """HF transformers greedy generation in the model's dtype, on its device, one prompt at a
    time (no padding)."""
    prompts = [list(tokenizer(p).input_ids) for p in RAW_PROMPTS]
    prompts += [chat_ids(tokenizer, p) for p in CHAT_PROMPTS]
    return [hf_greedy(model, tokenizer, ids, GOLDEN_NEW_TOKENS) for ids in prompts]


def hf_greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> Golden:
    """HF transformers' greedy continuation of one prompt (no padding), with its logprobs and
    top-2 margins."""
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([ids], device=model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.eos_token_id,
        )
    new = gen.sequences[0, len(ids) :].tolist()
    lps = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(gen.logits, new)]
    top2 = [step[0].float().topk(2).values.tolist() for step in gen.logits]
    return Golden(ids, new, lps, [a - b for a, b in top2])
