"""Attention backends behind one interface; pick one by name."""

from __future__ import annotations

from meshlm.scheduler.attention.base import AttentionBackend

__all__ = ["AttentionBackend", "create_backend", "BACKENDS"]

BACKENDS = ("torch_native",)


def create_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name; raise ValueError naming the allowed ones."""
    if name == "torch_native":
        from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend()
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
