"""The token bitmask of constrained decoding, shared by every grammar backend.

Layout (xgrammar's and llguidance's): an int32 CPU tensor [rows, ceil(vocab_size / 32)]; token
t is allowed in row r iff bit (t % 32) of word [r, t // 32] is set. A fresh mask allows every
token. `apply_vocab_mask` sets the logits of disallowed tokens to -inf in place, only in the
rows given (requests without a grammar share the batch and are left untouched).
"""

from __future__ import annotations

import torch

_BITS = 32


def allocate_vocab_mask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for `rows` rows (on CPU, where the matchers write it)."""
    return torch.full((rows, (vocab_size + _BITS - 1) // _BITS), -1, dtype=torch.int32)


def unpack_vocab_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab_size].bool()


def apply_vocab_mask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[i], t] = -inf for every token t that row i of `mask` disallows.

    `mask` has len(rows) rows (row i belongs to logits row rows[i]); tokens past the mask's
    width (a padded vocabulary) are disallowed too."""
    if not rows:
        return
    vocab = logits.shape[-1]
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)
    width = min(vocab, mask.shape[1] * _BITS)
    allowed[:, :width] = unpack_vocab_mask(mask.to(logits.device, non_blocking=True), width)
    idx = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
