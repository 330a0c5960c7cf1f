"""The decode plan's runner (kernels/csrc/decode_plan.c) on a hand-built list of ops: ops run in
order over their row ranges, and a timed run (the profile of bench/profile_engine.py
--cpu-graph) computes exactly what an untimed one does while adding each op's wall time to its
own slot."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from meshlm.scheduler.kernels import decode_plan as dp
from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.cpu_ops import CpuOps, load_cpu_ops

ROWS, HIDDEN = 8, 64


@pytest.fixture(scope="module")
def libs() -> tuple[CpuOps, ctypes.CDLL]:
    try:
        return load_cpu_ops(), dp.load_decode_plan_library()
    except KernelUnavailable as e:  # pragma: no cover - the CI machine has gcc
        pytest.skip(f"no C compiler: {e}")


def _plan(libs: tuple[CpuOps, ctypes.CDLL]) -> tuple[dp.DecodePlan, dict[str, torch.Tensor]]:
    """norm(x) -> h; SiLU*mul(gate_up) -> act (only for batches of >= 4 rows); norm(h) -> out."""
    ops, lib = libs
    torch.manual_seed(0)
    t = {
        "x": torch.randn(ROWS, HIDDEN),
        "w": torch.rand(HIDDEN) + 0.5,
        "h": torch.zeros(ROWS, HIDDEN),
        "gate_up": torch.randn(ROWS, 2 * HIDDEN),
        "act": torch.zeros(ROWS, HIDDEN),
        "out": torch.zeros(ROWS, HIDDEN),
    }
    silu = dp.silu_mul_op(ops, t["gate_up"], t["act"])
    plan_ops = [
        dp.add_rmsnorm_op(ops, t["x"], None, t["w"], t["h"], 1e-6),
        dataclasses.replace(silu, min_rows=4),
        dp.add_rmsnorm_op(ops, t["h"], None, t["w"], t["out"], 1e-6),
    ]
    return dp.DecodePlan(lib, plan_ops, list(t.values())), t


def test_a_timed_run_computes_what_an_untimed_one_does(libs: tuple[CpuOps, ctypes.CDLL]) -> None:
    plan, t = _plan(libs)
    plan.run(ROWS)
    want = {k: t[k].clone() for k in ("h", "act", "out")}
    for k in want:
        t[k].zero_()
    seconds = torch.zeros(3, dtype=torch.float64)
    plan.run(ROWS, seconds)
    for k, v in want.items():
        assert torch.equal(t[k], v), k
    assert bool((seconds > 0).all()), seconds
    again = seconds.clone()
    plan.run(ROWS, seconds)  # times add up over runs
    assert bool((seconds > again).all())


def test_an_op_outside_its_rows_neither_runs_nor_is_timed(libs: tuple[CpuOps, ctypes.CDLL]) -> None:
    plan, t = _plan(libs)
    seconds = torch.zeros(3, dtype=torch.float64)
    plan.run(2, seconds)  # the SiLU op takes batches of 4 rows and more
    assert seconds[0] > 0 and seconds[1] == 0 and seconds[2] > 0
    assert not t["act"].any() and t["out"][:2].any() and not t["out"][2:].any()


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(3, dtype=torch.float32),
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(6, dtype=torch.float64)[::2],
    ],
)
def test_the_time_buffer_is_checked_before_c_writes_to_it(libs: tuple[CpuOps, ctypes.CDLL], bad: torch.Tensor) -> None:
    plan, t = _plan(libs)
    with pytest.raises(ValueError, match="op_seconds"):
        plan.run(ROWS, bad)
    assert not t["h"].any()
