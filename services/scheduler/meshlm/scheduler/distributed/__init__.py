"""Tensor-parallel context: which shard this process holds and how shards talk.

A TpGroup is passed explicitly to every parallel layer (no global state of our own). With
size 1 every collective is the identity, so single-process CPU runs need no process group.
With size > 1 it uses torch.distributed's default process group, which
parallel_state.init_tp_group starts in every rank process (gloo on CPU, nccl on CUDA);
distributed/launch.py spawns those processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TpGroup", "SINGLE"]


@dataclass(frozen=True)
class TpGroup:
    """Rank and size of this process in its tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank must be in [0, {self.size}), got {self.rank}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group in place (identity for size 1)."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (the value itself for size 1); `device` is
        where the default group's backend takes tensors (cpu for gloo, cuda:rank for nccl)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (identity for size 1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of size `total`.

        Invariant: `total` must divide evenly; uneven sharding would silently misalign heads.
        """
        if total % self.size:
            raise ValueError(f"dimension {total} is not divisible by tp size {self.size}")
        n = total // self.size
        return self.rank * n, n


SINGLE = TpGroup()
