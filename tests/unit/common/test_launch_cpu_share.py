"""`meshlm launch` splits the host's CPUs among its schedulers (OMP_NUM_THREADS each) when it
starts more than one, keeps a user's own OMP_NUM_THREADS, and TP ranks split that share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshlm.common import cpus
from meshlm.launch.launcher import LaunchPlan, child_env, plan_children
from meshlm.scheduler.distributed.launch import threads_per_rank

CPUS = len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def no_cgroup_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The shares below are of CPUS, whatever quota this machine's cgroup has."""
    monkeypatch.setattr(cpus, "CGROUP_ROOT", tmp_path)


def _threads(plan: LaunchPlan, base: dict[str, str]) -> dict[str, str | None]:
    return {c.name: child_env(base, c).get("OMP_NUM_THREADS") for c in plan_children(plan)}


def test_one_scheduler_keeps_every_cpu() -> None:
    got = _threads(LaunchPlan(model_path="m", tokenizer_path="t"), {})
    assert set(got.values()) == {None}


def test_schedulers_split_the_cpus_and_other_services_are_left_alone() -> None:
    got = _threads(LaunchPlan(model_path="m", tokenizer_path="t", dp_size=2, decode_dp_size=1), {})
    share = str(max(1, CPUS // 3))
    assert {n: v for n, v in got.items() if "scheduler" in n} == {
        "scheduler-0": share,
        "scheduler-1": share,
        "decode-scheduler-0": share,
    }
    assert all(v is None for n, v in got.items() if "scheduler" not in n)


def test_a_users_omp_num_threads_wins() -> None:
    got = _threads(LaunchPlan(model_path="m", tokenizer_path="t", dp_size=2), {"OMP_NUM_THREADS": "7"})
    assert {n: v for n, v in got.items() if "scheduler" in n} == {"scheduler-0": "7", "scheduler-1": "7"}


@pytest.mark.parametrize(("env", "size", "want"), [("1", 2, 1), ("4", 2, min(CPUS, 4) // 2 or 1), ("", 1, CPUS)])
def test_tp_ranks_split_the_schedulers_share(monkeypatch: pytest.MonkeyPatch, env: str, size: int, want: int) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert threads_per_rank(size) == max(1, want)
