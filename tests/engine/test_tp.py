"""Tensor parallelism on CPU (gloo): an Engine with tp_size=N runs N rank processes whose
greedy tokens equal tp_size=1 and HF transformers, on tiny random Llama / Qwen2 models (KV
heads split, and one KV head replicated over both ranks with a padded vocabulary) and on
SmolLM2 with tp_size=3; bad sizes and ranks that fail to start fail the start-up fast."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import re
import time
from pathlib import Path

import pytest
import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed.launch import start_tp_group
from meshlm.scheduler.engine import Engine
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.runtime import follower_rank

from .conftest import GOLDEN_NEW_TOKENS, assert_pools_whole
from .test_models import hf_greedy

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "東京は日本の",
    "Once upon a time, in a land far away, there lived a king who had three daughters",
]
NEW_TOKENS = 16
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# Sampled requests draw from the top 20 tokens. A random tiny model's distribution is nearly
# flat over the whole 49K vocabulary (each token ~2e-5 of the mass), so an inverse-CDF draw over
# all of it lands on a neighbouring id whenever tp=2's logits differ from tp=1's in the last
# float32 bits (other GEMM blocking; seen on an AVX2 CPU): the ranks agree, the bits do not.
SEEDED = {
    "temperature": 0.9,
    "top_k": 20,
    "top_p": 0.95,
    "sampling_seed": 1234,
    "max_new_tokens": NEW_TOKENS,
    "ignore_eos": True,
}
UNSEEDED = {"temperature": 0.9, "top_k": 20, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# Small chunks: the long prompt is prefilled in several chunks while the others decode.
ENGINE_FLAGS = dict(dtype="float32", max_total_tokens=2048, chunked_prefill_size=8, load_progress=False, random_seed=7)

# (architecture, KV heads, tied embeddings, vocab padding): 4 query heads throughout.
CASES = {
    "llama-kv2": ("llama", 2, False, 0),
    "qwen2-bias-kv2": ("qwen2", 2, False, 0),
    "llama-kv1-replicated-tied-odd-vocab": ("llama", 1, True, 1),
}


def build_model(kind: str, kv_heads: int, tied: bool, extra_vocab: int, out_dir: Path, tokenizer) -> torch.nn.Module:
    """A 2-layer random model (4 heads, head_dim 16) with the SmolLM2 tokenizer, saved as HF."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=len(tokenizer) + extra_vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        for layer in model.model.layers:  # HF initialises biases to zero: make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model.eval()


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """(greedy tokens of every prompt submitted at once, a seeded sampled request's tokens,
    an unseeded sampled request alone: its draws from the engine's seeded RNG are fixed)."""
    greedy = engine.generate_batch_sync(
        [{"input_ids": ids, "sampling_params": GREEDY} for ids in prompts]
        + [{"input_ids": prompts[0], "sampling_params": SEEDED}]
    )
    alone = engine.generate_sync(input_ids=prompts[1], sampling_params=UNSEEDED)
    assert_pools_whole(engine)
    return [r["output_ids"] for r in greedy[:-1]], greedy[-1]["output_ids"], alone["output_ids"]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_and_hf(case: str, tmp_path: Path, smollm_tokenizer) -> None:
    kind, kv_heads, tied, extra_vocab = CASES[case]
    model = build_model(kind, kv_heads, tied, extra_vocab, tmp_path, smollm_tokenizer)
    prompts = [list(smollm_tokenizer(p).input_ids) for p in PROMPTS]
    assert len(prompts[-1]) > 2 * ENGINE_FLAGS["chunked_prefill_size"]
    expected = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    threads = torch.get_num_threads()

    with Engine(model_path=str(tmp_path), **ENGINE_FLAGS) as eng:
        single = run(eng, prompts)
    with Engine(model_path=str(tmp_path), tp_size=2, **ENGINE_FLAGS) as eng:
        runner = eng.scheduler.tp_worker.model_runner
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # this rank's shard
        assert runner.model.model.embed_tokens.shard_size == (len(smollm_tokenizer) + extra_vocab + 1) // 2
        ranks = eng.runtime.tp_ranks
        assert ranks is not None and len(ranks.procs) == 1 and ranks.procs[0].is_alive()
        parallel = run(eng, prompts)

    assert single[0] == expected
    assert parallel == single
    assert [p.exitcode for p in ranks.procs] == [0]  # rank 1 left when rank 0 stopped
    assert not torch.distributed.is_initialized()
    assert torch.get_num_threads() == threads


def test_smollm2_tp3_golden_tokens(smollm_path: str, golden) -> None:
    """9 heads, 3 KV heads, intermediate 1536 and vocab 49152 split three ways."""
    picked = [golden[0], golden[2]]
    sp = {"temperature": 0, "max_new_tokens": GOLDEN_NEW_TOKENS}
    with Engine(dtype="float32", model_path=smollm_path, tp_size=3, max_total_tokens=4096, load_progress=False) as eng:
        res = eng.generate_batch_sync([{"input_ids": g.input_ids, "sampling_params": sp} for g in picked])
        assert [r["output_ids"] for r in res] == [g.output_ids for g in picked]
        assert_pools_whole(eng)


def test_bad_tp_size_fails_fast_naming_tp_size(tmp_path: Path, smollm_tokenizer) -> None:
    build_model("llama", 2, False, 0, tmp_path, smollm_tokenizer)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tp_size 3 must divide num_attention_heads \(4\)"):
        Engine(dtype="float32", model_path=str(tmp_path), tp_size=3, load_progress=False)
    assert time.monotonic() - t0 < 10
    assert not multiprocessing.active_children()  # refused before any rank was spawned

    mc = ModelConfig.from_path(tmp_path)
    mc.verify_tp_size(4)  # 4 heads, 2 KV heads replicated twice, intermediate 128
    bad = {
        r"tp_size 6 must divide num_key_value_heads \(4\) or be a multiple of it": (
            6,
            {"num_attention_heads": 12, "num_key_value_heads": 4},
        ),
        r"tp_size 4 must divide intermediate_size \(130\)": (4, {"intermediate_size": 130}),
        "tp_size must be 1 for embedding models": (2, {"is_embedding": True}),
    }
    for message, (tp_size, fields) in bad.items():
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(mc, **fields).verify_tp_size(tp_size)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_rank_stops_rank_0_promptly(tmp_path: Path, smollm_tokenizer) -> None:
    """Rank 1 is killed: rank 0's next broadcast fails at once, its loop reports the crash
    (which fails every waiting request), and shutdown leaves no group behind."""
    build_model("llama", 2, False, 0, tmp_path, smollm_tokenizer)
    with Engine(
        dtype="float32", model_path=str(tmp_path), tp_size=2, max_total_tokens=2048, load_progress=False
    ) as eng:
        ranks = eng.runtime.tp_ranks
        assert ranks is not None
        ranks.procs[0].kill()
        t0 = time.monotonic()
        # Promptly: rank 0's next broadcast fails on the dead peer's socket; the bound is
        # generous for a loaded 2-core CI machine (one fresh-clone CI run saw more than 10 s).
        while eng.runtime.is_alive() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert not eng.runtime.is_alive(), f"rank 0 still running {time.monotonic() - t0:.0f} s after rank 1 died"
        # The OS tells gloo of the dead peer as EOF ("closed") or, when the killed rank had
        # unread data, as a reset: which one is a race of the kill, not of our code.
        assert re.search(r"Connection (closed|reset) by peer", str(eng.runtime.crashed))
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()


def test_rank_that_fails_to_start_fails_rank_0_with_its_error(tmp_path: Path) -> None:
    """Rank 1 cannot load its model; rank 0 waits in a collective for it. The start-up fails
    with rank 1's traceback, promptly, and leaves no group and no process behind."""
    bad = SchedulerConfig(model_path=str(tmp_path / "missing"), tp_size=2, load_progress=False)
    cpu = torch.device("cpu")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)tensor-parallel rank 1 failed to start.*missing.*does not exist"):
        start_tp_group(2, cpu, functools.partial(follower_rank, bad), lambda tp, group: tp.min_over_ranks(1, cpu))
    assert time.monotonic() - t0 < 60
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()
