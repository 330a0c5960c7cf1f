"""Greedy outputs of our engine equal HF transformers on SmolLM2-135M in float32, under every
scheduling configuration that must not change results; pools are whole after each run."""

from __future__ import annotations

import pytest

from meshlm.scheduler.engine import Engine
from meshlm.scheduler.layers import cpu_gemm
from tests.golden import CHAT_PROMPTS, RAW_PROMPTS, SCHEDULING_CONFIGS, hf_greedy

from .conftest import GOLDEN_NEW_TOKENS, assert_pools_whole

GREEDY = {"temperature": 0, "max_new_tokens": GOLDEN_NEW_TOKENS}


def run_all(engine: Engine, golden, at_once: bool = True, logprobs: bool = False) -> list[dict]:
    reqs = [{"input_ids": g.input_ids, "sampling_params": GREEDY, "return_logprob": logprobs} for g in golden]
    if at_once:
        return engine.generate_batch_sync(reqs)
    return [engine.generate_batch_sync([r])[0] for r in reqs]


@pytest.fixture(scope="module")
def engine(smollm_path: str):
    eng = Engine(dtype="float32", model_path=smollm_path, max_total_tokens=16384, load_progress=False)
    yield eng
    eng.shutdown()


def test_greedy_tokens_and_logprobs_match_hf(engine: Engine, golden) -> None:
    results = run_all(engine, golden, logprobs=True)
    for g, r in zip(golden, results):
        assert r["output_ids"] == g.output_ids
        ours = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
        assert len(ours) == len(g.logprobs)
        assert max(abs(a - b) for a, b in zip(ours, g.logprobs)) < 1e-3
    assert_pools_whole(engine)


def test_one_at_a_time_equals_batched(engine: Engine, golden) -> None:
    results = run_all(engine, golden, at_once=False)
    assert [r["output_ids"] for r in results] == [g.output_ids for g in golden]
    assert_pools_whole(engine)


def test_32_concurrent_requests(engine: Engine, golden) -> None:
    many = (golden * 4)[:32]
    results = run_all(engine, many)
    assert [r["output_ids"] for r in results] == [g.output_ids for g in many]
    assert_pools_whole(engine)


@pytest.mark.parametrize("overrides", list(SCHEDULING_CONFIGS.values()), ids=list(SCHEDULING_CONFIGS))
def test_same_tokens_under_config(smollm_path: str, golden, overrides: dict) -> None:
    with Engine(
        dtype="float32", model_path=smollm_path, max_total_tokens=8192, load_progress=False, **overrides
    ) as eng:
        results = run_all(eng, golden)
        assert [r["output_ids"] for r in results] == [g.output_ids for g in golden]
        assert_pools_whole(eng)


@pytest.mark.parametrize("chunk", [2048, 16], ids=["default-chunk", "chunk16"])
def test_small_pool_forces_retraction(smollm_path: str, golden, chunk: int) -> None:
    # 16 requests of ~10-40 prompt tokens + 32 outputs need ~1100 slots. With a low
    # conservativeness, admission reserves almost nothing for future outputs, so decoding in a
    # 320-slot pool runs out and must retract (and later recompute) requests; the decode steps
    # of running requests also ride in the prefill batches (mixed chunk, the default).
    many = (golden * 2)[:16]
    with Engine(
        dtype="float32",
        model_path=smollm_path,
        max_total_tokens=320,
        schedule_conservativeness=0.05,
        chunked_prefill_size=chunk,
        load_progress=False,
    ) as eng:
        results = run_all(eng, many)
        assert [r["output_ids"] for r in results] == [g.output_ids for g in many]
        assert eng.scheduler.stats.num_retracted > 0
        assert eng.scheduler.stats.mixed_decode_tokens > 0
        assert_pools_whole(eng)


def test_default_model_decodes_small_batches_from_its_gguf_blocks(engine: Engine) -> None:
    """SmolLM2 ships as GGUF Q4_1 with a Q8_0 embedding (the tied LM head): on CPU every linear
    is held as those blocks too (GEMV for a few rows, the block GEMM for decode batches up to
    256), so the golden tests above ran through them."""
    from meshlm.scheduler.layers.cpu_gemm import prepack_supported
    from meshlm.scheduler.layers.linear import ColumnParallelLinear, RowParallelLinear

    runner = engine.scheduler.tp_worker.model_runner
    if runner.device.type != "cpu" or not prepack_supported() or engine.config.fused_ops != "auto":
        pytest.skip("the small-batch GEMV path is the CPU's")
    linears = [m for m in runner.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    formats = {m.packed.small.format for m in linears if m.packed is not None and m.packed.small is not None}
    head = runner.model.logits_processor.packed_head
    assert len(linears) == 4 * runner.model_config.num_hidden_layers
    assert formats == {"q4_1"}
    assert head is not None and head.small is not None and head.small.format == "q8_0"
    if head.gemm_ops is not None:  # AVX2 + FMA
        assert all(m.packed.blocks is not None for m in linears if m.packed is not None)
        assert head.blocks is not None


@pytest.mark.parametrize("library", ["onednn", "mkl"])
def test_a_long_prompt_through_each_prompt_gemm_matches_hf(
    smollm_path: str, hf_smollm, smollm_tokenizer, monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    """A prompt past the block GEMM's rows takes the prompt GEMM (--cpu-prompt-gemm) in every
    layer; either library gives HF's greedy tokens and logprobs."""
    ids = list(smollm_tokenizer(" ".join(RAW_PROMPTS + CHAT_PROMPTS) * 8).input_ids)[:320]
    want = hf_greedy(hf_smollm, smollm_tokenizer, ids, 8)
    rows: list[int] = []
    mkl = cpu_gemm.mkl_linear
    monkeypatch.setattr(cpu_gemm, "mkl_linear", lambda x, w, b: rows.append(x.shape[0]) or mkl(x, w, b))
    with Engine(
        dtype="float32", model_path=smollm_path, cpu_prompt_gemm=library, max_total_tokens=4096, load_progress=False
    ) as eng:
        rows.clear()  # the start-up self-checks
        sp = {"temperature": 0, "max_new_tokens": 8}
        (out,) = eng.generate_batch_sync([{"input_ids": ids, "sampling_params": sp, "return_logprob": True}])
        assert_pools_whole(eng)
    assert out["output_ids"] == want.output_ids
    ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, want.logprobs)) < 1e-3
    assert (len([r for r in rows if r > 256]) >= 30) == (library == "mkl")
