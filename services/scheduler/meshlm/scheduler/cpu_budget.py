"""How many CPUs this scheduler process may use: the OpenMP thread count of its kernels.

torch (and so every OpenMP kernel here, which takes torch.get_num_threads()) sizes its pool from
the CPUs it can be scheduled on, not from a container's CPU quota: a pod limited to 4 CPUs on a
64-core node would run 64 threads and be throttled for most of every step. The budget is the
smallest of: the affinity mask, the cgroup's CPU quota rounded up (cgroup v2 `cpu.max`, or v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), and OMP_NUM_THREADS where set (`meshlm launch` sets
it for each of several schedulers on one host).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path | None = None) -> int | None:
    """CPUs the cgroup's quota allows (ceil(quota / period), at least 1); None without a quota
    or where no cgroup file can be read. root: the cgroup mount (default CGROUP_ROOT)."""
    root = root or CGROUP_ROOT
    try:
        fields = (root / "cpu.max").read_text().split()  # v2: "max 100000" or "400000 100000"
        quota, period = (None, None) if fields[0] == "max" else (int(fields[0]), int(fields[1]))
    except (OSError, ValueError, IndexError):
        try:  # v1: a quota of -1 means none
            quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
            period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            return None
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def cpu_budget(root: Path | None = None) -> int:
    """CPUs for this process's threads (see the module docstring); at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, limit)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        cpus = min(cpus, int(env))
    return max(1, cpus)


def apply_cpu_budget(root: Path | None = None) -> int:
    """Lower torch's intra-op threads to the budget (never raise them); returns the count."""
    budget = cpu_budget(root)
    if torch.get_num_threads() > budget:
        logger.info("CPU budget %d (affinity, cgroup quota, OMP_NUM_THREADS): %d threads", budget, budget)
        torch.set_num_threads(budget)
    return torch.get_num_threads()
