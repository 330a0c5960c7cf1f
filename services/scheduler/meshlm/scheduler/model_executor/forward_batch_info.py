"""ForwardBatch: everything one model forward needs, as tensors (SGLang's forward_batch_info).

Layout of a batch of B requests with T tokens in total ("packed", no padding):

    input_ids / positions / out_cache_loc   [T]   tokens of request 0, then request 1, ...
    seq_lens                                [B]   total length of each request after this forward
    extend_prefix_lens                      [B]   tokens already in the KV cache (EXTEND only)
    extend_seq_lens                         [B]   new tokens of each request (EXTEND); 1 each in DECODE
    req_pool_indices                        [B]   rows of ReqToTokenPool.req_to_token

Invariant: seq_lens == extend_prefix_lens + extend_seq_lens, and sum(extend_seq_lens) == T.
The KV of token j of request i (0-based over the whole sequence) lives at
req_to_token[req_pool_indices[i], j]; this forward writes the new tokens' KV to out_cache_loc.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshlm.scheduler.attention.base import AttentionBackend
    from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    """What the forward computes."""

    EXTEND = 1  # prefill: new tokens appended after a (possibly empty) cached prefix
    DECODE = 2  # one new token per request
    IDLE = 3  # nothing to run
    EMBED = 4  # encoder / pooling forward without KV cache reuse

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.EMBED)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Tensors for one forward; built by ScheduleBatch, consumed by ModelRunner and the model."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int64 (on the device)
    req_pool_indices: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor | None  # [T] int64; None for EMBED without KV
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None
    # Logprob requests: per request, the first position (relative to the extend start)
    # whose input logprob is wanted; len == B. Empty when no request asks for input logprobs.
    return_logprob: bool = False
    extend_logprob_start_lens_cpu: list[int] = field(default_factory=list)
    # Optional per-forward metadata the attention backend caches (built in init_forward_metadata).
    attn_metadata: object = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
