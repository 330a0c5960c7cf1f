"""Rotary position embedding (neox / HF "rotate_half" layout) with optional rope scaling."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from meshlm.scheduler.kernels.cpu_ops import CpuOps


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


RopeCosSin = tuple[torch.Tensor, torch.Tensor]  # cos, sin of one forward's positions, [T, 1, D] each


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions.

    One instance serves every layer of a model: cos/sin are cached once for positions
    [0, max_position) in float32 (a per-layer cache would cost layers x max_position x head_dim
    x 8 bytes: 4 GB for a 32-layer, 128K-context, head-dim-128 model), and a forward looks them
    up once (cos_sin) for all its layers (rotate). A position beyond the cache grows it (requests
    are validated against the context length before they get here).
    """

    # Buffers (register_buffer), declared for the type checker.
    inv_freq: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", _inv_freq(head_dim, base, rope_scaling), persistent=False)
        self._build(max_position)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def _ensure(self, positions: torch.Tensor) -> None:
        """Grow the tables past the largest position. Skipped while a CUDA graph is captured
        (reading the max would sync); the graph runner only replays positions < max_position."""
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            self._build(int(positions.max()) * 2)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeCosSin:
        """cos, sin of `positions` [T], each [T, 1, D] in `dtype`, for rotate()."""
        self._ensure(positions)
        return (self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype))

    def batch(self, positions: torch.Tensor, dtype: torch.dtype, ops: CpuOps | None = None) -> RopeBatch:
        """RoPE for one forward's positions, shared by all its layers."""
        self._ensure(positions)
        return RopeBatch(self, positions, dtype, ops)

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, cos_sin: RopeCosSin) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] rotated by cos_sin (from cos_sin()), same dtypes."""
        cos, sin = cos_sin
        return _apply(q, cos, sin), _apply(k, cos, sin)


class RopeBatch:
    """RoPE of one forward, applied by every layer to its packed qkv projection.

    With `ops` (CPU) the q and k heads are rotated in place in the qkv rows by one C pass that
    reads the cos/sin tables by position; otherwise cos/sin are looked up once here and applied
    with torch ops (which allocate the rotated q and k).
    """

    def __init__(self, emb: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, ops: CpuOps | None) -> None:
        self.emb, self.positions, self.ops = emb, positions, ops
        self.cos_sin: RopeCosSin | None = None if ops is not None else emb.cos_sin(positions, dtype)

    def rotate_qkv(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hk) * D] -> rotated q [T, Hq, D], rotated k [T, Hk, D], v [T, Hk, D]."""
        t, d = qkv.shape[0], head_dim
        q_size, kv_size = num_heads * d, num_kv_heads * d
        if self.ops is not None and self.ops.supports(qkv):
            self.ops.rope_neox(qkv, num_heads, num_kv_heads, d, self.positions, self.emb.cos_cache, self.emb.sin_cache)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            return q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.cos_sin is None:  # ops given but this qkv not theirs (e.g. float16): look up once
            self.cos_sin = self.emb.cos_sin(self.positions, qkv.dtype)
        q, k = RotaryEmbedding.rotate(q.view(t, -1, d), k.view(t, -1, d), self.cos_sin)
        return q, k, v.reshape(t, -1, d)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
