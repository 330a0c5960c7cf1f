"""Attention backends behind one interface; pick one by name."""

from __future__ import annotations

import logging

import torch

from meshlm.scheduler.attention.base import AttentionBackend
from meshlm.scheduler.config import ATTENTION_BACKENDS

__all__ = ["AttentionBackend", "create_backend", "BACKENDS"]

log = logging.getLogger(__name__)

# auto: on CPU the fused C decode kernel when it builds here (else torch_native), with the C
# extend kernel when that builds too (else SDPA for long extend segments; SDPA also for bf16
# pools on CPUs with native bf16, where it is faster); on CUDA the Triton kernels when triton
# imports and a one-launch self-check passes (else torch_native). cpu: the decode kernel or a
# start-up error saying why it is unavailable. triton: the Triton kernels (CUDA; on CPU only
# under TRITON_INTERPRET=1, for tests).
BACKENDS = ATTENTION_BACKENDS


def create_backend(name: str, device: torch.device, num_heads: int = 0, head_dim: int = 0) -> AttentionBackend:
    """Instantiate a backend by name for `device` (num_heads: query heads of this rank, and
    head_dim, size the Triton backend's decode scratch); raise ValueError naming the allowed ones."""
    from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend

    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from meshlm.scheduler.attention.triton_backend import TritonAttnBackend, triton_unusable
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"attention_backend 'triton' is unavailable: {e}") from e
            log.warning("triton is not importable (%s); attention uses torch_native", e)
            return TorchNativeAttnBackend()
        if name == "auto":
            why = triton_unusable(device)
            if why is not None:
                log.warning("Triton attention kernels do not run here (%s); attention uses torch_native", why)
                return TorchNativeAttnBackend()
        return TritonAttnBackend(num_heads, head_dim, device)
    if name == "torch_native" or (name == "auto" and device.type != "cpu"):
        return TorchNativeAttnBackend()
    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' needs device cpu, got {device.type}")
    from meshlm.scheduler.attention.cpu import CpuAttnBackend
    from meshlm.scheduler.attention.cpu_kernel import KernelUnavailable, load_decode_kernel
    from meshlm.scheduler.attention.extend_kernel import (
        AmxExtendKernel,
        ExtendKernel,
        load_amx_extend_kernel,
        load_extend_kernel,
    )
    from meshlm.scheduler.kernels.cpu_features import cpu_has_amx_bf16, cpu_has_native_bf16

    try:
        decode = load_decode_kernel()
    except KernelUnavailable as e:
        if name == "cpu":
            raise ValueError(f"attention_backend 'cpu' is unavailable: {e}") from e
        log.warning("CPU decode-attention kernel unavailable (%s); using torch_native", e)
        return TorchNativeAttnBackend()
    extend: ExtendKernel | None = None
    try:
        extend = load_extend_kernel()
    except KernelUnavailable as e:
        log.info("CPU extend-attention kernel unavailable (%s); long extend segments use SDPA", e)
    amx: AmxExtendKernel | None = None
    if cpu_has_native_bf16():  # AMX tiles, or the same tile program on AVX512-BF16
        try:
            amx = load_amx_extend_kernel()
        except KernelUnavailable as e:
            log.info("bf16 tile extend-attention kernel unavailable (%s); bf16 prompts use SDPA", e)
    return CpuAttnBackend(decode, extend, (torch.bfloat16,) if cpu_has_amx_bf16() else (), amx)
