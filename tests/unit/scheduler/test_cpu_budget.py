"""The scheduler's CPU budget: a container's cgroup quota (v2 cpu.max, v1 cfs files) and
OMP_NUM_THREADS bound the thread pool below the CPUs it may be scheduled on; it never grows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshlm.common.cpus import cgroup_cpu_limit
from meshlm.scheduler.cpu_budget import apply_cpu_budget, cpu_budget

CPUS = len(os.sched_getaffinity(0))


def v2(tmp_path: Path, text: str) -> Path:
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def v1(tmp_path: Path, quota: int, period: int) -> Path:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


@pytest.mark.parametrize(("text", "want"), [("max 100000\n", None), ("400000 100000\n", 4), ("150000 100000", 2)])
def test_cgroup_v2_quota(tmp_path: Path, text: str, want: int | None) -> None:
    assert cgroup_cpu_limit(v2(tmp_path, text)) == want


@pytest.mark.parametrize(("quota", "want"), [(-1, None), (50000, 1), (300000, 3)])
def test_cgroup_v1_quota(tmp_path: Path, quota: int, want: int | None) -> None:
    assert cgroup_cpu_limit(v1(tmp_path, quota, 100000)) == want


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    assert cgroup_cpu_limit(v2(tmp_path, "garbage")) is None


def test_budget_is_the_smallest_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_budget(tmp_path) == CPUS  # no cgroup files under tmp_path
    assert cpu_budget(v2(tmp_path, "100000 100000")) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_budget(v2(tmp_path, "max 100000")) == 1


def test_apply_lowers_torch_threads_and_never_raises_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert apply_cpu_budget(v2(tmp_path, "100000 100000")) == 1 == torch.get_num_threads()
        assert apply_cpu_budget(v2(tmp_path, "max 100000")) == 1  # a larger budget leaves it
    finally:
        torch.set_num_threads(before)
