"""Memory pools: the request→token table and the per-layer K/V byte buffers.

Two-level indirection (SGLang's layout):

    ReqToTokenPool.req_to_token[row, pos] = slot   KV slot of position `pos` of the request in `row`
    MHATokenToKVPool.k_buffer[layer][slot]          the key of that token in that layer (same for V)

Which slots are free is decided by `TokenToKVPoolAllocator` (allocator.py); these pools only
hold data. Row 0 of `req_to_token` and page 0 of the K/V buffers (slots 0..page_size-1) are
reserved dummies: padded batch entries point at them, and they are never handed out.
"""

from __future__ import annotations

import torch

from meshlm.scheduler.mem_cache.zeroed_memory import Populator, can_populate_later, zeroed

Device = str | torch.device

# Float8 types are stored as raw bytes: index_put is not implemented for them on every backend.
_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


class ReqToTokenPool:
    """Maps (request row, token position) to a KV slot.

    Invariants:
      * `req_to_token` has shape [size + 1, max_context_len]; row 0 is a dummy, never handed out.
      * Every row in 1..size is either free (in `_free_rows`) or owned by exactly one request.
      * The table contents of a free row are meaningless; owners write before reading.
    """

    def __init__(self, size: int, max_context_len: int, device: Device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size and max_context_len must be positive, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int64, device=self.device)
        self._free_rows: list[int] = []
        self._in_use: list[bool] = []
        self.clear()

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, need: int) -> list[int] | None:
        """Hand out `need` rows, or None (handing out nothing) if fewer are free."""
        if need > len(self._free_rows):
            return None
        rows = self._free_rows[:need]
        del self._free_rows[:need]
        for row in rows:
            self._in_use[row] = True
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Return rows to the pool. Raises on row 0, out-of-range rows and double frees."""
        rows = [idx] if isinstance(idx, int) else list(idx)
        for row in rows:
            if not 1 <= row <= self.size:
                raise ValueError(f"row {row} is not a usable row (1..{self.size})")
            if not self._in_use[row]:
                raise ValueError(f"row {row} freed twice")
            self._in_use[row] = False
        self._free_rows.extend(rows)

    def clear(self) -> None:
        """Mark every usable row free."""
        self._free_rows = list(range(1, self.size + 1))
        self._in_use = [False] * (self.size + 1)


class MHATokenToKVPool:
    """Per-layer K and V buffers for multi-head (and grouped-query) attention.

    Invariants:
      * `k_buffer[l]` and `v_buffer[l]` have shape [size + page_size, head_num, head_dim].
      * Slots 0..page_size-1 form the padding page: padded tokens write to slot 0 and no real
        token ever lives there. Real slots are page_size..size + page_size - 1, matching the
        allocator built with the same (size, page_size).
      * Values are stored in `dtype` (float8 as its raw bytes; the getters view them back).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: Device = "cpu",
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in _FP8_DTYPES else dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        shape = (size + page_size, head_num, head_dim)
        # Zero-filled: a padded entry reads the padding page, and SDPA's masked keys still
        # enter its products (0 * NaN), so no slot may hold garbage. On CPU the buffers are
        # anonymous mappings (zeros from the kernel) made resident by a background thread
        # (mem_cache/zeroed_memory.py): start-up does not wait for 2 GiB of page faults.
        lazy = self.device.type == "cpu" and can_populate_later()
        self.k_buffer: list[torch.Tensor] = [
            zeroed(shape, self.store_dtype, self.device, lazy=lazy) for _ in range(layer_num)
        ]
        self.v_buffer: list[torch.Tensor] = [
            zeroed(shape, self.store_dtype, self.device, lazy=lazy) for _ in range(layer_num)
        ]
        self.populator = Populator(self.k_buffer + self.v_buffer, "KV pool").start() if lazy else None

    @staticmethod
    def cell_size_bytes(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token over all layers (to size the pool from a budget)."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * head_num * head_dim * layer_num * elem

    def mem_usage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[layer_id])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_buffer[layer_id])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K/V of T tokens to slots `loc` [T]; cache_k/v are [T, H, D] (or [T, H*D])."""
        cache_k = cache_k.reshape(-1, self.head_num, self.head_dim)
        cache_v = cache_v.reshape(-1, self.head_num, self.head_dim)
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
            cache_v = cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
            cache_v = cache_v.view(self.store_dtype)
        self.k_buffer[layer_id][loc] = cache_k
        self.v_buffer[layer_id][loc] = cache_v
