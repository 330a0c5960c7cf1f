"""What the bf16 GEMM tests (test_gemm_bf16.py, test_gemm_amx.py) compare against: the product of
the bf16 operands in float64, and closeness within one bf16 rounding of it."""

from __future__ import annotations

import torch


def bf16_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of the bf16 operands in float64: what the kernels round once to bf16."""
    return torch.nn.functional.linear(
        x.double(), w.to(torch.bfloat16).double(), None if bias is None else bias.double()
    )


def within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a bf16 rounding of the result (plus float32 summation noise)."""
    return bool(((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-3).all())
