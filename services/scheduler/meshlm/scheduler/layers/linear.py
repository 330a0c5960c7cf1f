"""Tensor-parallel linear layers (Megatron style) with HF-checkpoint weight loaders.

ColumnParallelLinear splits the output dimension: rank r holds rows [r*n, (r+1)*n) of W.
RowParallelLinear splits the input dimension and all-reduces the partial products.
QKVParallelLinear and MergedColumnParallelLinear are column-parallel layers whose output
is a concatenation of several logical matrices (q|k|v, gate|up); their weight loaders place
each checkpoint tensor into its own slice of this rank's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.layers.cpu_gemm import PackedLinear, PackPlan, prepack_weight


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows sharded over the TP group (no gather).

    After prepack() (CPU, once the weights are loaded) the weight lives in oneDNN's blocked
    layout (layers/cpu_gemm.py) and the dense parameter is empty.
    """

    packed: PackedLinear | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TpGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        _, self.output_size_per_partition = tp.shard(output_size)
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype), requires_grad=False)
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        start, n = self.tp.shard(loaded.shape[0])
        _copy_into(param.data, loaded.narrow(0, start, n), "column-parallel")

    def prepack(self, plan: PackPlan | None = None) -> bool:
        self.packed = prepack_weight(self, True, plan)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b; W's input columns are sharded. prepack() as in
    ColumnParallelLinear (the bias stays outside: it is added once, after the reduction)."""

    packed: PackedLinear | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TpGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        _, self.input_size_per_partition = tp.shard(input_size)
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is replicated, added once after the reduction
            _copy_into(param.data, loaded, "row-parallel bias")
            return
        start, n = self.tp.shard(loaded.shape[1])
        _copy_into(param.data, loaded.narrow(1, start, n), "row-parallel")

    def prepack(self, plan: PackPlan | None = None) -> bool:
        self.packed = prepack_weight(self, False, plan)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one: output = [out_0 | out_1 | ...] per rank."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TpGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, tp, params_dtype)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        # Rank-local offset of logical matrix `shard_id` = sum of the earlier matrices' shards.
        offset = sum(self.tp.shard(s)[1] for s in self.output_sizes[:shard_id])
        start, n = self.tp.shard(self.output_sizes[shard_id])
        _copy_into(param.data.narrow(0, offset, n), loaded.narrow(0, start, n), f"merged[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; heads are sharded, KV heads replicated if fewer
    KV heads than ranks (each rank then holds one copy of the KV head its query heads use)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp: TpGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = total_num_heads // tp.size
        self.num_kv_heads = max(1, total_num_kv_heads // tp.size)
        # Logical output = (heads + 2 * kv_heads) * head_dim across all ranks.
        total = (self.num_heads + 2 * self.num_kv_heads) * tp.size * head_dim
        super().__init__(hidden_size, total, bias, tp, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        d = self.head_dim
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            dst, start, n = param.data.narrow(0, 0, q_rows), self.tp.rank * q_rows, q_rows
        elif shard_id in ("k", "v"):
            off = q_rows if shard_id == "k" else q_rows + kv_rows
            dst = param.data.narrow(0, off, kv_rows)
            # With replication, ranks r*rep .. r*rep+rep-1 share KV head r // rep.
            rep = max(1, self.tp.size // self.total_num_kv_heads)
            start, n = (self.tp.rank // rep) * kv_rows, kv_rows
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        _copy_into(dst, loaded.narrow(0, start, n), f"qkv[{shard_id}]")
