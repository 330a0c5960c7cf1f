"""Decode through CudaGraphRunner gives the tokens and logprobs of the eager forward.

On CUDA (bench/gpu_check.sh runs this module with MESHLM_TEST_DEVICE=cuda) the engine captures
real CUDA graphs at start-up and is compared with an engine started with disable_cuda_graph. On
CPU there is nothing to capture: the runner runs in eager mode (same static buffers, padding to
the next captured size and slicing; the forward re-run instead of replayed), which checks all of
its index arithmetic. Batches of 1..11 concurrent requests shrink as requests finish, so decode
batches of every size from 11 down to 1 run: captured sizes (1, 2, 4, 8), sizes between them
(3, 5, 6, 7) and sizes past the largest (9..11, eager fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.scheduler.engine import Engine
from meshlm.scheduler.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from tests.golden import compute_golden

from .conftest import TEST_DEVICE, Golden, assert_pools_whole
from .test_models import build_tiny

SIZES = [1, 2, 4, 8]
BATCHES = [1, 3, 5, 8, 11]
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer) -> tuple[str, list[Golden]]:
    out: Path = tmp_path_factory.mktemp("tiny-graph")
    hf = build_tiny("llama", out, tiny_tokenizer)
    return str(out), compute_golden(hf, tiny_tokenizer)


def _run(eng: Engine, golden: list[Golden], n: int) -> list[dict]:
    batch = (golden * 2)[:n]
    reqs = [
        {"input_ids": g.input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8 + 3 * i}}
        for i, g in enumerate(batch)
    ]
    for r in reqs:
        r["return_logprob"] = True
    return eng.generate_batch_sync(reqs)


def _assert_same(graph: list[dict], eager: list[dict]) -> None:
    for k, (a, b) in enumerate(zip(graph, eager, strict=True)):
        assert a["output_ids"] == b["output_ids"], f"request {k}: graph {a['output_ids']} eager {b['output_ids']}"
        lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
        worst = max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True))
        assert worst < LOGPROB_TOL, f"request {k}: logprobs differ by {worst:.2e}"


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(160)[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert capture_batch_sizes(160)[-1] == 160
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(100)[-2:] == [96, 100]


def test_graph_decode_matches_eager(tiny: tuple[str, list[Golden]]) -> None:
    path, golden = tiny
    flags = {"model_path": path, "device": TEST_DEVICE, "dtype": "float32", "load_progress": False}
    flags["max_total_tokens"] = 8192
    flags["disable_cpu_graph"] = True  # on CPU the float32 decode plan would take these steps
    with Engine(disable_cuda_graph=True, **flags) as eager:
        assert eager.scheduler.tp_worker.model_runner.graph_runner is None
        want = {n: _run(eager, golden, n) for n in BATCHES}
    with Engine(cuda_graph_max_bs=8, **flags) as eng:
        runner = eng.scheduler.tp_worker.model_runner
        if TEST_DEVICE == "cpu":
            assert runner.graph_runner is None  # graphs are a CUDA feature
            runner.graph_runner = CudaGraphRunner(runner, SIZES, eager=True).capture()
        graphs = runner.graph_runner
        assert graphs is not None and graphs.batch_sizes == SIZES
        for n in BATCHES:
            before = graphs.num_replays
            _assert_same(_run(eng, golden, n), want[n])
            # with <= 8 requests every decode step replays (the longest asks 8 + 3(n-1) tokens,
            # the first from the prefill); past 8 the steps after the first 3 finish replay
            assert graphs.num_replays - before >= (8 + 3 * (n - 1) - 1 if n <= 8 else 1)
        assert graphs.padded_rows > 0  # batches of 3, 5, 6, 7 ran padded
        assert_pools_whole(eng)
