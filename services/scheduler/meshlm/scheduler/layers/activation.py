"""SwiGLU activation over a merged [gate | up] projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from meshlm.scheduler.kernels.cpu_ops import CpuOps


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim (equal halves) -> silu(gate) * up; one C pass when
    ModelRunner set `cpu_ops` (CPU)."""

    cpu_ops: CpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and self.cpu_ops.supports(x):
            return self.cpu_ops.silu_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
