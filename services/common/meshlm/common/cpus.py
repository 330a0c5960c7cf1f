"""The CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota.

A container limited to 4 CPUs on a 64-core node sees 64 in its affinity mask; the quota
(cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up, is what it
may actually use. Torch-free: the launcher splits this among schedulers, the scheduler sizes
its thread pool from it (scheduler/cpu_budget.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

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


def available_cpus(root: Path | None = None) -> int:
    """The affinity mask's CPUs, at most the cgroup quota's; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    return max(1, min(cpus, limit) if limit is not None else cpus)


def serial_tokenizers() -> None:
    """Keep HF `tokenizers` on the calling thread in this process (TOKENIZERS_PARALLELISM=false,
    unless the environment already says otherwise). Must run before the first encode / decode.

    Left parallel, a batch decode or encode starts a rayon pool of one thread per core whose
    idle threads spin in sched_yield after every call. In the detokenizer that was ~20 yields a
    decode step at concurrency 1 (strace), on the cores the scheduler's OpenMP threads need;
    the batches the relays tokenize or detokenize (one step's requests) are too small to gain
    from the pool.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def batch_scheduling() -> bool:
    """Put every thread of this process under Linux's SCHED_BATCH policy (threads it starts
    later inherit it); False where the OS has no such policy.

    SCHED_BATCH is the normal fair-share policy minus wake-up preemption: a thread that wakes
    (a relay receiving one gRPC message) waits for the running thread's slice instead of
    preempting it at once. For a relay on the cores of a scheduler that is what keeps the
    scheduler's OpenMP team together: a worker preempted in the middle of a GEMM stalls the
    whole team at the next barrier. Nice value and CPU share are unchanged (no privilege
    needed); SCHED_IDLE, the stronger policy, starved the relays behind a busy scheduler.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return True
