"""The rank processes of one tensor-parallel group: rank 0 (the caller) spawns ranks 1..N-1.

`start_tp_group(size, device, follower, leader)`:

1. picks a free loopback port for the rendezvous (`tcp://127.0.0.1:PORT`);
2. spawns ranks 1..N-1 (multiprocessing "spawn" context, daemonic). Each limits torch's
   threads, watches its parent, joins the group, runs `follower(tp, cpu_group)` (its start-up,
   which returns its serving function), reports "ready" or its traceback on a pipe, then
   serves until that function returns (exit 0). Any failure exits non-zero;
3. joins the group as rank 0 and runs `leader(tp, cpu_group)` in a helper thread, while the
   calling thread watches the children: a child's error or death fails the start-up with that
   child's error, and an error of rank 0 fails it with that error; either way every child is
   killed and the group is left.

It returns once the leader returned and every child reported ready.

Invariants:
* no orphans: a child exits when its parent dies (a watchdog on the parent pid, not
  PR_SET_PDEATHSIG, which fires when the *thread* that spawned the child ends, and rank 0
  spawns from whatever thread builds the runtime); its collectives also fail once rank 0's
  sockets close;
* children ignore SIGINT: a terminal's Ctrl-C reaches the whole process group, and only
  rank 0 decides when the ranks stop (a child that died first would crash rank 0's drain);
  SIGTERM still kills them (TpRanks.join / multiprocessing's exit handler use it);
* on CPU each rank, rank 0 included, runs torch with cpus // size intra-op threads (two
  rank processes with a full OpenMP pool each slow every matmul down many times); rank 0's
  previous thread count comes back at join().
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch
import torch.distributed as dist

from meshlm.common.ports import free_port
from meshlm.scheduler.cpu_budget import cpu_budget
from meshlm.scheduler.distributed import TpGroup
from meshlm.scheduler.distributed.parallel_state import COLLECTIVE_TIMEOUT, destroy_tp_group, init_tp_group

logger = logging.getLogger(__name__)

T = TypeVar("T")
Follower = Callable[[TpGroup, dist.ProcessGroup], Callable[[], None]]
"""A rank > 0's start-up (run in the child; must pickle, e.g. a functools.partial of a
module-level function): builds that rank's state and returns the function that serves until
rank 0 says stop."""
Leader = Callable[[TpGroup, dist.ProcessGroup], T]
"""Rank 0's start-up (run in this process); its result is start_tp_group's."""

WATCHDOG_INTERVAL_S = 0.5
FAILED_LEADER_JOIN_S = 5.0  # how long a failed start waits for rank 0's helper to leave the group


def threads_per_rank(size: int) -> int:
    """torch intra-op threads for each of `size` CPU ranks sharing this process's CPU budget
    (cpu_budget.py: affinity, cgroup quota, OMP_NUM_THREADS)."""
    return max(1, cpu_budget() // size)


def _watch_parent(parent_pid: int) -> None:
    """Exit this process (code 1) as soon as its parent is gone."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=run, name="tp-parent-watchdog", daemon=True).start()


def _rank_main(
    rank: int,
    size: int,
    init_method: str,
    device_type: str,
    threads: int,
    parent_pid: int,
    conn: multiprocessing.connection.Connection,
    follower: Follower,
    log_level: int,
) -> None:
    """Entry point of rank `rank` > 0 (see the module docstring for its life)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(parent_pid)
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    if device_type == "cpu":
        torch.set_num_threads(threads)
    try:
        tp, cpu_group = init_tp_group(rank, size, init_method, torch.device(device_type))
        serve = follower(tp, cpu_group)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        os._exit(1)  # no interpreter teardown: a half-joined process group may block in it
    conn.send(("ready", ""))
    conn.close()
    try:
        serve()
    except BaseException:
        logger.exception("tensor-parallel rank %d stops: its loop failed (rank 0 gone?)", rank)
        os._exit(1)
    destroy_tp_group()


class TpRanks:
    """Handle on ranks 1..N-1 of a running TP group, held by rank 0."""

    def __init__(self, procs: list[mp.process.BaseProcess], restore_threads: int) -> None:
        self.procs = procs
        self.restore_threads = restore_threads
        self.stopped = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def terminate(self) -> None:
        """Kill every child still running (SIGTERM) and reap it."""
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(FAILED_LEADER_JOIN_S)
            if p.exitcode is None:
                p.kill()
                p.join()

    def join(self, timeout: float) -> None:
        """After rank 0's loop broadcast its stop: wait up to `timeout` s for the children to
        exit, kill those that did not, leave the group and give rank 0 its threads back.
        Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [p.pid for p in self.procs if p.exitcode is None]
        if stuck:
            logger.warning("tensor-parallel ranks %s did not stop within %.0fs: killing them", stuck, timeout)
        self.terminate()
        destroy_tp_group()
        torch.set_num_threads(self.restore_threads)


def start_tp_group(size: int, device: torch.device, follower: Follower, leader: Leader[T]) -> tuple[TpRanks, T]:
    """Start a TP group of `size` ranks on `device` (type cpu or cuda); see the module docstring.

    Raises ValueError when CUDA has fewer than `size` devices, RuntimeError naming the rank
    and carrying its traceback when a child fails to start, and rank 0's own error otherwise.
    """
    if size < 2:
        raise ValueError(f"tp_size must be >= 2 to start rank processes, got {size}")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tp_size {size} needs {size} CUDA devices, {torch.cuda.device_count()} visible")
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = threads_per_rank(size)
    ranks = TpRanks([], torch.get_num_threads())
    conns: list[multiprocessing.connection.Connection] = []
    result: Future[T] = Future()
    helper = threading.Thread(
        target=_lead, args=(size, init_method, device, leader, result), name="tp-rank-0-start", daemon=True
    )
    try:
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            conns.append(recv)
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    size,
                    init_method,
                    device.type,
                    threads,
                    os.getpid(),
                    send,
                    follower,
                    logging.getLogger().getEffectiveLevel(),
                ),
                name=f"meshlm-tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            ranks.procs.append(proc)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        logger.info("tensor parallelism %d: ranks 1..%d are processes %s (%s)", size, size - 1, ranks.pids, init_method)
        helper.start()
        _await_start(result, ranks.procs, conns)
    except BaseException:
        ranks.terminate()
        if helper.ident is not None:
            helper.join(FAILED_LEADER_JOIN_S)  # its collectives fail once the children are gone
        if helper.is_alive():  # still in the rendezvous: it times out without joining a group
            logger.warning("rank 0 is still waiting for the rendezvous; it gives up within %s", COLLECTIVE_TIMEOUT)
        else:
            ranks.join(0.0)
        torch.set_num_threads(ranks.restore_threads)
        raise
    finally:
        for conn in conns:
            conn.close()
    return ranks, result.result()


def _lead(size: int, init_method: str, device: torch.device, leader: Leader[T], result: Future[T]) -> None:
    """Rank 0's start-up in the helper thread; a failure leaves the group it joined."""
    try:
        tp, cpu_group = init_tp_group(0, size, init_method, device)
    except BaseException as e:
        result.set_exception(e)
        return
    try:
        result.set_result(leader(tp, cpu_group))
    except BaseException as e:
        destroy_tp_group()
        result.set_exception(e)


def _await_start(
    result: Future[T], procs: list[mp.process.BaseProcess], conns: list[multiprocessing.connection.Connection]
) -> None:
    """Wait until rank 0's start-up finished and every child reported ready; raise the first
    error: a child's report, a child's death, or rank 0's exception."""
    ready: set[int] = set()
    while True:
        for i, (proc, conn) in enumerate(zip(procs, conns)):
            rank = i + 1
            if rank not in ready and conn.poll():
                try:
                    kind, text = conn.recv()
                except EOFError:
                    kind, text = "error", f"the process exited (code {proc.exitcode}) before reporting"
                if kind == "error":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{text}")
                ready.add(rank)
            if proc.exitcode is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} during start-up")
        if result.done():
            result.result()  # rank 0's own error, if any
            if len(ready) == len(procs):
                return
        pending = [c for i, c in enumerate(conns) if i + 1 not in ready]
        multiprocessing.connection.wait([*pending, *(p.sentinel for p in procs)], timeout=0.05)
