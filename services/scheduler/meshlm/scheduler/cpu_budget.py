"""How many CPUs this scheduler process may use: the OpenMP thread count of its kernels.

torch (and so every OpenMP kernel here, which takes torch.get_num_threads()) sizes its pool from
the CPUs it can be scheduled on, not from a container's CPU quota: a pod limited to 4 CPUs on a
64-core node would run 64 threads and be throttled for most of every step. The budget is the
smallest of: the affinity mask, the cgroup's CPU quota rounded up (common/cpus.py), and
OMP_NUM_THREADS where set (`meshlm launch` sets it for each of several schedulers on one host).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from meshlm.common.cpus import available_cpus

logger = logging.getLogger(__name__)


def cpu_budget(root: Path | None = None) -> int:
    """CPUs for this process's threads (see the module docstring); at least 1. root: the
    cgroup mount (default common.cpus.CGROUP_ROOT)."""
    cpus = available_cpus(root)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        cpus = min(cpus, int(env))
    return cpus


def apply_cpu_budget(root: Path | None = None) -> int:
    """Lower torch's intra-op threads to the budget (never raise them); returns the count."""
    budget, before = cpu_budget(root), torch.get_num_threads()
    if before > budget:
        logger.info("CPU budget (affinity, cgroup quota, OMP_NUM_THREADS): %d threads instead of %d", budget, before)
        torch.set_num_threads(budget)
    return torch.get_num_threads()
