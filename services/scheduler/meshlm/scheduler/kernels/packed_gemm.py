"""What our dense bf16 GEMM bindings share (kernels/gemm_bf16.py, kernels/gemm_amx.py): a weight
packed once into a kernel's layout, and the checks x, the weight and the bias pass before their
pointers reach C. A subclass names its kernel and layout, says which shapes it takes, and makes
the two C calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class PackedWeightBf16:
    """A [out_features, in_features] weight rounded to bf16, out_features * in_features bf16 in
    the layout `layout` names (a weight packed for one kernel is refused by another)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    layout: str

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class PackedGemmBf16(ABC):
    """y = x W^T (+ bias) for bf16 x [M, K] and a packed W; bias float32 [N]; y bf16 [M, N]."""

    name: ClassVar[str]  # the kernel, in error messages
    layout: ClassVar[str]

    @staticmethod
    @abstractmethod
    def shape_problem(out_features: int, in_features: int) -> str | None:
        """Why the kernel cannot take a weight of this shape, or None when it can."""

    @abstractmethod
    def _pack_c(self, w: torch.Tensor, n: int, k: int, data: torch.Tensor) -> int:
        """The C packing of contiguous bf16 w [n, k] into data; non-zero when refused."""

    @abstractmethod
    def _gemm_c(self, x: torch.Tensor, w: PackedWeightBf16, bias: torch.Tensor | None, out: torch.Tensor) -> int:
        """The C product into out (x as _rows made it); non-zero when refused."""

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as the C side reads it (default: unit stride along K)."""
        return x if x.stride(1) == 1 else x.contiguous()

    def pack(self, weight: torch.Tensor) -> PackedWeightBf16:
        """weight [N, K] (any float dtype; rounded to bf16) in the kernel's layout."""
        n, k = weight.shape
        problem = self.shape_problem(n, k)
        if problem is not None:
            raise ValueError(f"{self.name} needs {problem}, got [{n}, {k}]")
        w = weight.detach().to(torch.bfloat16).contiguous()
        data = torch.empty(n * k, dtype=torch.bfloat16)
        if self._pack_c(w, n, k, data):
            raise ValueError(f"{self.name} cannot pack a [{n}, {k}] weight")
        return PackedWeightBf16(data, n, k, self.layout)

    def gemm(self, x: torch.Tensor, weight: PackedWeightBf16, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 @ weight^T (+ bias, float32 [N]) -> bf16 [M, N]."""
        m, k = x.shape
        n = weight.out_features
        if weight.layout != self.layout:
            raise ValueError(f"{self.name} got a weight packed for {weight.layout}")
        if x.dtype != torch.bfloat16 or k != weight.in_features:
            raise ValueError(f"{self.name} needs bf16 x [M, {weight.in_features}], got {x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (n,)):
            raise ValueError(f"{self.name} bias must be a contiguous float32 [{n}]")
        out = torch.empty((m, n), dtype=torch.bfloat16)
        if m == 0:
            return out
        rc = self._gemm_c(self._rows(x), weight, bias, out)
        if rc:
            raise ValueError(f"{self.name}: unsupported shape {tuple(x.shape)} x [{n}, {k}] (rc {rc})")
        return out
