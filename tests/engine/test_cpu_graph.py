"""Decode through CpuGraphRunner (one C call a step) gives the tokens and logprobs of the eager
forward, which calls the same C kernels one by one from Python.

bf16 and float32 models on CPU. Each decode step the plan takes is also run eagerly on the same
batch, and the logits must be equal bit for bit (same kernels, same order). bf16 (CPUs with
AVX512-BF16): tiny Llama and Qwen2 (q/k/v bias) models through the AMX GEMM and, forced, the
panel GEMM of CPUs without AMX; SmolLM2, whose converted GGUF blocks take the block GEMV for
batches of 1-4 rows and the GEMM above. float32: the tiny models' dense weights through the
float32 GEMV (batches of up to 4 rows; larger ones are oneDNN's, so eager); SmolLM2's blocks
through the block GEMV up to 8 rows and the block GEMM above. Batches of
1..11 requests shrink as requests finish, so every decode size from 11 to 1 runs; a plan of 4
rows leaves 5..11 to the eager forward. A RoPE table that grows mid-run makes the plan rebuild
over the new table. End to end, one request at a time, an engine with the plan gives the tokens
and logprobs of one started with disable_cpu_graph (batches of several requests are formed as
they arrive, which changes bf16 rounding between any two runs, plan or not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshlm.scheduler.engine import Engine
from meshlm.scheduler.kernels import decode_plan as dp
from meshlm.scheduler.kernels.cpu_features import cpu_flags, cpu_has_amx_bf16
from meshlm.scheduler.layers.logits_processor import LogitsProcessorOutput
from meshlm.scheduler.model_executor import model_runner
from meshlm.scheduler.model_executor.cpu_graph_runner import CpuGraphRunner
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch
from meshlm.scheduler.model_executor.model_runner import ModelRunner
from tests.golden import compute_golden

from .conftest import TEST_DEVICE, Golden, assert_pools_whole
from .test_models import build_tiny

BATCHES = [1, 3, 5, 11]
LOGPROB_TOL = 1e-3

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the decode plan is the CPU's graph")
needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the bf16 C GEMMs need AVX512-BF16")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory, tiny_tokenizer) -> tuple[str, list[Golden]]:
    out: Path = tmp_path_factory.mktemp(f"tiny-plan-{request.param}")
    hf = build_tiny(request.param, out, tiny_tokenizer)
    return str(out), compute_golden(hf, tiny_tokenizer)


def _run(eng: Engine, golden: list[Golden], n: int, new_tokens: int = 8) -> list[dict]:
    batch = (golden * 4)[:n]
    reqs = [
        {
            "input_ids": g.input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens + 3 * i},
            "return_logprob": True,
        }
        for i, g in enumerate(batch)
    ]
    return eng.generate_batch_sync(reqs)


def _assert_same(plan: list[dict], eager: list[dict]) -> None:
    for k, (a, b) in enumerate(zip(plan, eager, strict=True)):
        assert a["output_ids"] == b["output_ids"], f"request {k}: plan {a['output_ids']} eager {b['output_ids']}"
        lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
        worst = max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True))
        assert worst < LOGPROB_TOL, f"request {k}: logprobs differ by {worst:.2e}"


class CheckedPlan:
    """Stands in for the runner's CpuGraphRunner: every decode step it takes also runs the eager
    forward on the same batch first (which stores the same K/V to the same slots) and records
    whether the plan's logits equal it bit for bit (asserted by the test, not on the loop
    thread)."""

    def __init__(self, runner: ModelRunner, plan: CpuGraphRunner) -> None:
        self.runner, self.plan = runner, plan
        self.sizes: list[int] = []
        self.mismatches: list[str] = []

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.plan.can_run(fb)

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        self.runner.graph_runner = None
        try:
            out = self.runner.forward(fb)
            assert isinstance(out, LogitsProcessorOutput)
            want = out.next_token_logits.clone()
        finally:
            self.runner.graph_runner = self
        got = self.plan.replay(fb)
        self.sizes.append(fb.batch_size)
        if not torch.equal(got.next_token_logits, want):
            worst = float((got.next_token_logits - want).abs().max())
            self.mismatches.append(f"batch of {fb.batch_size}: logits differ by up to {worst:.3e}")
        return got


def _checked(
    path: str,
    golden: list[Golden],
    batches: list[int],
    max_rows: int | None = None,
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
) -> CheckedPlan:
    """An engine whose decode steps go through CheckedPlan; every run ends with whole pools."""
    flags = {
        "model_path": path,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "load_progress": False,
        "max_total_tokens": 8192,
    }
    with Engine(**flags) as eng:
        runner = eng.scheduler.tp_worker.model_runner
        plan = runner.graph_runner if max_rows is None else CpuGraphRunner(runner, max_rows)
        assert isinstance(plan, CpuGraphRunner)
        checked = CheckedPlan(runner, plan)
        runner.graph_runner = checked
        for n in batches:
            before = plan.num_replays
            _run(eng, golden, n)
            longest = 8 + 3 * (n - 1)  # tokens; the first comes from the prefill
            if n <= plan.max_rows:
                assert plan.num_replays - before >= longest - 1
            else:  # the steps of > max_rows requests ran eagerly, the rest in the plan
                assert 0 < plan.num_replays - before < longest - 1
        assert_pools_whole(eng)
    assert not checked.mismatches, checked.mismatches
    return checked


@needs_bf16
def test_plan_decode_matches_eager(tiny: tuple[str, list[Golden]]) -> None:
    checked = _checked(*tiny, BATCHES)
    assert set(range(1, 12)) <= set(checked.sizes)  # every size from 11 down to 1


@needs_bf16
def test_plan_engine_matches_eager_engine(tiny: tuple[str, list[Golden]]) -> None:
    """End to end, one request at a time (no batch timing involved): the same tokens and logprobs
    as an engine started with disable_cpu_graph."""
    path, golden = tiny
    flags = {"model_path": path, "dtype": "bfloat16", "load_progress": False, "max_total_tokens": 8192}
    with Engine(disable_cpu_graph=True, **flags) as eager:
        assert eager.scheduler.tp_worker.model_runner.graph_runner is None
        want = [_run(eager, [g], 1)[0] for g in golden[:4]]
    with Engine(**flags) as eng:
        plan = eng.scheduler.tp_worker.model_runner.graph_runner
        assert isinstance(plan, CpuGraphRunner)
        got = [_run(eng, [g], 1)[0] for g in golden[:4]]
        assert plan.num_replays >= 4 * 7
    _assert_same(got, want)


@needs_bf16
def test_batches_past_max_rows_run_eagerly(tiny: tuple[str, list[Golden]]) -> None:
    checked = _checked(*tiny, [11], max_rows=4)
    assert checked.plan.max_rows == 4 and max(checked.sizes) == 4


@needs_bf16
@pytest.mark.skipif(not cpu_has_amx_bf16(cpu_flags()), reason="the panel GEMM is forced only where AMX would win")
def test_panel_gemm_plan_matches_eager(tiny: tuple[str, list[Golden]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan on a CPU with AVX512-BF16 but no AMX: linears through the panel GEMM."""
    from meshlm.scheduler.kernels.gemm_bf16 import load_gemm_bf16

    monkeypatch.setattr(model_runner, "gemm_amx_or_none", lambda: None)
    monkeypatch.setattr(model_runner, "gemm_bf16_or_none", load_gemm_bf16)
    checked = _checked(*tiny, [1, 5])
    assert {op.kind for op in checked.plan.plan.ops} >= {dp.GEMM_PANEL} and dp.GEMM_AMX not in {
        op.kind for op in checked.plan.plan.ops
    }


@needs_bf16
def test_rope_table_growth_rebuilds_the_plan(tiny: tuple[str, list[Golden]]) -> None:
    path, golden = tiny
    flags = {"model_path": path, "dtype": "bfloat16", "load_progress": False, "max_total_tokens": 8192}
    with Engine(**flags) as eng:
        runner = eng.scheduler.tp_worker.model_runner
        emb = runner.model.model.rotary_emb
        emb._build(max(len(g.input_ids) for g in golden[:3]) + 2)  # decode positions outgrow it
        plan = CpuGraphRunner(runner, 8)
        checked = CheckedPlan(runner, plan)
        runner.graph_runner = checked
        first_table = emb.cos_cache
        _run(eng, golden, 3, new_tokens=24)
        assert emb.cos_cache is not first_table and plan._tables[0] is emb.cos_cache
        assert plan.num_replays > 0 and not checked.mismatches, checked.mismatches


@needs_bf16
def test_smollm2_plan_matches_eager(smollm_path: str, smollm_tokenizer) -> None:
    """The packaged model: batches of 1-4 rows through the block GEMV of its GGUF blocks."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    golden = [Golden(list(smollm_tokenizer(p).input_ids), [], []) for p in prompts]
    checked = _checked(smollm_path, golden, [1, 6])
    kinds = {op.kind for op in checked.plan.plan.ops}
    assert dp.GEMV_BF16 in kinds and kinds & {dp.GEMM_AMX, dp.GEMM_PANEL}
    assert {1, 2, 3, 4, 5, 6} <= set(checked.sizes)


def test_float32_plan_matches_eager(tiny: tuple[str, list[Golden]]) -> None:
    """Dense float32 weights: the plan covers the float32 GEMV's 4 rows; 5..11 run eagerly."""
    checked = _checked(*tiny, BATCHES, dtype="float32")
    kinds = {op.kind for op in checked.plan.plan.ops}
    assert dp.GEMV_F32 in kinds and checked.plan.max_rows == 4
    assert set(checked.sizes) == {1, 2, 3, 4}


def test_float32_plan_engine_matches_eager_engine(tiny: tuple[str, list[Golden]]) -> None:
    path, golden = tiny
    flags = {"model_path": path, "dtype": "float32", "load_progress": False, "max_total_tokens": 8192}
    with Engine(disable_cpu_graph=True, **flags) as eager:
        want = [_run(eager, [g], 1)[0] for g in golden[:4]]
    with Engine(**flags) as eng:
        plan = eng.scheduler.tp_worker.model_runner.graph_runner
        assert isinstance(plan, CpuGraphRunner)
        got = [_run(eng, [g], 1)[0] for g in golden[:4]]
        assert plan.num_replays >= 4 * 7
    _assert_same(got, want)


def test_smollm2_float32_plan_matches_eager(smollm_path: str, smollm_tokenizer) -> None:
    """SmolLM2's GGUF blocks in float32: the block GEMV for 1-8 rows, the block GEMM above."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    golden = [Golden(list(smollm_tokenizer(p).input_ids), [], []) for p in prompts]
    checked = _checked(smollm_path, golden, [1, 11], dtype="float32")
    kinds = {op.kind for op in checked.plan.plan.ops}
    assert {dp.GEMV_Q4_1, dp.GEMM_Q} <= kinds
    assert set(range(1, 12)) <= set(checked.sizes)


def test_float32_plan_over_a_bf16_kv_pool_matches_eager(tiny: tuple[str, list[Golden]]) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: the plan stores and reads the bf16 pool
    as the eager forward does (its decode kernel rounds the new K/V in C, the eager one too)."""
    checked = _checked(*tiny, [1, 3], dtype="float32", kv_cache_dtype="bfloat16")
    assert checked.runner.token_to_kv_pool.dtype == torch.bfloat16
    assert {1, 2, 3} <= set(checked.sizes)
