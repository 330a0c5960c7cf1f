"""Process groups of one tensor-parallel group, and Python objects broadcast over them.

Every rank of a TP group joins two groups:

* the model's collectives: torch.distributed's default group (gloo on CPU, nccl on CUDA),
  which TpGroup's all_reduce / all_gather use inside the forward;
* a gloo group over the same ranks on the CPU, for `broadcast_pyobj` (rank 0 sends each loop
  iteration's input messages to the other ranks), so scheduler traffic never waits behind or
  interleaves with the model's collectives.

Invariant: at most one TP group per process at a time (the default group is process-wide);
`destroy_tp_group` ends it so that a later group can start in the same process.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshlm.scheduler.distributed import TpGroup

__all__ = ["COLLECTIVE_TIMEOUT", "broadcast_pyobj", "destroy_tp_group", "init_tp_group"]

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""Rendezvous deadline and the longest any rank waits in one collective. Ranks > 0 wait in
each iteration's broadcast only while rank 0 polls its inbox (50 ms) or runs the same step."""


def init_tp_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout: timedelta = COLLECTIVE_TIMEOUT
) -> tuple[TpGroup, dist.ProcessGroup]:
    """Join the TP group as `rank`: the default group for the model and a gloo CPU group.

    init_method is `tcp://127.0.0.1:PORT` (rank 0 hosts the store there). On CUDA this rank's
    device becomes cuda:rank before NCCL starts. Blocks until every rank joined or `timeout`.
    """
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group already runs in this process")
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(list(range(size)), backend="gloo", timeout=timeout)
    return TpGroup(rank, size), cpu_group


def destroy_tp_group() -> None:
    """Leave the TP group (both process groups); a no-op when none is running."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_pyobj(obj: Any, rank: int, group: dist.ProcessGroup, src: int = 0) -> Any:
    """Send a picklable object from rank `src` to every rank of the CPU `group`; return it.

    The source returns `obj` itself; the others return an unpickled copy (its length travels
    first, then the bytes). Every rank of the group must call this, in the same order.
    """
    if rank == src:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=src, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group)
        return obj
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return pickle.loads(payload.numpy().tobytes())
