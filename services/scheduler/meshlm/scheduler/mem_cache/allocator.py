"""TokenToKVPoolAllocator: which KV slots are free, handed out a page at a time.

Slot/page arithmetic (P = page_size, N = size // P pages):

    page p holds slots p*P .. p*P + P - 1
    slot s belongs to page s // P, at page offset s % P
    page 0 (slots 0..P-1) is the padding page and is never handed out
    usable pages are 1..N, i.e. slots P .. N*P + P - 1

A page only ever holds consecutive positions of one request, page-aligned: position `pos` of a
request lives at offset `pos % P` of its page. So a request whose last filled position is
`pos - 1` at slot `last_loc` continues at `last_loc + 1` while `pos % P != 0`, and needs a fresh
page when `pos % P == 0`. With P == 1 every slot is its own page and all of this is trivial.

Free pages are kept as an int64 tensor (`_free_pages`, handed out from the front) plus freed
pages staged in `_release` that are sorted and merged in only when the front runs short, which
keeps allocations roughly ascending (memory locality) without sorting on every free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Device = str | torch.device
IntSeq = Sequence[int] | torch.Tensor


class TokenToKVPoolAllocator:
    """Page allocator over `size` token slots (page_size 1 or more).

    Invariants (checked on every call when `debug=True`):
      * free pages + allocated pages == num_pages; no page is handed out twice.
      * Callers free each page exactly once: either free all slots of a page in one `free`
        call (or one free group), or free any one slot of it; `free` dedups pages within a call
        or group but cannot know about earlier calls. Freeing slot s frees the whole page s // P.
      * The padding page 0 is never handed out. Freeing it is an error in debug mode and is
        silently dropped otherwise (padding entries must never poison the free list).
    """

    def __init__(self, size: int, page_size: int, device: Device = "cpu", debug: bool = False):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size  # round down to whole pages
        self.device = torch.device(device)
        self.debug = debug
        self._in_free_group = False
        self._free_group: list[torch.Tensor] = []
        self.clear()

    # ---- bookkeeping -----------------------------------------------------------------------
    def clear(self) -> None:
        """Mark every usable page free (pages 1..num_pages)."""
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._release: list[torch.Tensor] = []
        self._num_release = 0
        self._in_free_group = False
        self._free_group = []
        if self.debug:
            self._page_is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
            self._page_is_free[0] = False

    def available_size(self) -> int:
        """Free tokens (free pages * page_size)."""
        return (self._free_pages.numel() + self._num_release) * self.page_size

    def free_page_ids(self) -> torch.Tensor:
        """All free page ids, sorted (for tests and leak checks; not for the hot path)."""
        return torch.sort(torch.cat([self._free_pages, *self._release]))[0]

    def _take_pages(self, num: int) -> torch.Tensor | None:
        """Remove `num` pages from the free list, or return None (taking nothing)."""
        if num > self._free_pages.numel() + self._num_release:
            return None
        if num > self._free_pages.numel():
            staged = torch.sort(torch.cat(self._release))[0]
            self._free_pages = torch.cat([self._free_pages, staged])
            self._release = []
            self._num_release = 0
        pages = self._free_pages[:num]
        self._free_pages = self._free_pages[num:]
        if self.debug:
            cpu = pages.cpu()
            if not bool(self._page_is_free[cpu].all()):
                raise AssertionError("allocator handed out a page that is not free")
            self._page_is_free[cpu] = False
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Every slot of each page, page by page: [p*P, p*P+1, ..., p*P+P-1, ...]."""
        if self.page_size == 1:
            return pages.clone()
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def _as_tensor(self, values: IntSeq) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(device=self.device, dtype=torch.int64)
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    # ---- allocation ------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots made of whole fresh pages (page_size must divide need_size)."""
        if need_size % self.page_size != 0:
            raise ValueError(f"alloc({need_size}) is not a multiple of page_size {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._pages_to_slots(pages)

    def alloc_extend(
        self,
        prefix_lens: IntSeq,
        seq_lens: IntSeq,
        last_loc: IntSeq,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for positions prefix_lens[i]..seq_lens[i]-1 of every request, concatenated.

        `last_loc[i]` is the slot of position prefix_lens[i]-1 (-1 when the prefix is empty).
        Positions inside the request's partially filled last page continue it; the rest get
        fresh pages. Returns None, allocating nothing, when there are not enough free pages.
        """
        P = self.page_size
        # Lengths on the CPU so the page count needs no device sync.
        pre_cpu = torch.as_tensor(prefix_lens, dtype=torch.int64).cpu()
        seq_cpu = torch.as_tensor(seq_lens, dtype=torch.int64).cpu()
        ext_cpu = seq_cpu - pre_cpu
        if int(ext_cpu.sum()) != extend_num_tokens or bool((ext_cpu < 0).any()):
            raise ValueError("alloc_extend: seq_lens - prefix_lens must be >= 0 and sum to extend_num_tokens")
        if P == 1:
            return self.alloc(extend_num_tokens)
        # Pages already touched by the prefix: ceil(pre / P); needed after: ceil(seq / P).
        pre_pages = (pre_cpu + P - 1) // P
        new_pages_per_req = (seq_cpu + P - 1) // P - pre_pages
        pages = self._take_pages(int(new_pages_per_req.sum()))
        if pages is None:
            return None
        if extend_num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)

        dev = self.device
        pre = pre_cpu.to(dev)
        ext = ext_cpu.to(dev)
        last = self._as_tensor(last_loc)
        bs = pre.numel()
        # Output token j belongs to request req[j] and sits at position pos[j] of it.
        req = torch.repeat_interleave(torch.arange(bs, device=dev), ext)
        ext_start = torch.cumsum(ext, 0) - ext  # first output index of each request
        pos = pre[req] + (torch.arange(extend_num_tokens, device=dev) - ext_start[req])
        # Positions before the first fresh page boundary continue the partial page: the prefix
        # ends at slot last (position pre-1), so position pos is at last + (pos - pre) + 1.
        first_fresh_pos = pre_pages.to(dev)[req] * P
        in_partial = pos < first_fresh_pos
        partial_slot = last[req] + (pos - pre[req]) + 1
        if pages.numel() == 0:
            return partial_slot
        # Otherwise: the k-th fresh page of the request, k = pos // P - ceil(pre / P), found in
        # `pages` after the fresh pages of the requests before it.
        page_start = (torch.cumsum(new_pages_per_req, 0) - new_pages_per_req).to(dev)
        k = pos // P - pre_pages.to(dev)[req]
        # (Partial-page tokens index page 0 of `pages` just to stay in range; where() drops it.)
        fresh_idx = torch.where(in_partial, torch.zeros_like(k), page_start[req] + k)
        fresh_slot = pages[fresh_idx] * P + pos % P
        return torch.where(in_partial, partial_slot, fresh_slot)

    def alloc_decode(self, seq_lens: IntSeq, last_loc: IntSeq) -> torch.Tensor | None:
        """One slot per request for position seq_lens[i]-1 (seq_lens include the new token).

        Continues the page of last_loc[i] (slot of position seq_lens[i]-2) unless the new
        position starts a page. Returns None, allocating nothing, if pages run out.
        """
        P = self.page_size
        if P == 1:
            return self.alloc(len(seq_lens))
        seq_cpu = torch.as_tensor(seq_lens, dtype=torch.int64).cpu()
        # Position seq-1 starts a page exactly when (seq-1) % P == 0.
        needs_page_cpu = (seq_cpu - 1) % P == 0
        pages = self._take_pages(int(needs_page_cpu.sum()))
        if pages is None:
            return None
        last = self._as_tensor(last_loc)
        if pages.numel() == 0:
            return last + 1
        needs_page = needs_page_cpu.to(self.device)
        # The i-th request needing a page takes pages[i]: rank = running count - 1.
        rank = (torch.cumsum(needs_page.to(torch.int64), 0) - 1).clamp(min=0)
        return torch.where(needs_page, pages[rank] * P, last + 1)

    # ---- freeing ---------------------------------------------------------------------------
    def free(self, indices: torch.Tensor) -> None:
        """Free the pages holding these slots (deduplicated within the call or free group)."""
        if indices.numel() == 0:
            return
        if self._in_free_group:
            # Copy: callers often pass views of req_to_token rows that are rewritten later.
            self._free_group.append(indices.clone())
            return
        pages = torch.unique(indices.to(self.device, torch.int64) // self.page_size)
        if self.debug:
            cpu = pages.cpu()
            if bool((cpu < 1).any()) or bool((cpu > self.num_pages).any()):
                raise AssertionError(f"freeing slots outside the usable pages: {cpu.tolist()}")
            if bool(self._page_is_free[cpu].any()):
                raise AssertionError("double free of a KV page")
            self._page_is_free[cpu] = True
        else:
            pages = pages[pages > 0]
        if pages.numel():
            self._release.append(pages)
            self._num_release += pages.numel()

    def free_group_begin(self) -> None:
        """Start accumulating frees; they happen at once in free_group_end. Not nestable."""
        if self._in_free_group:
            raise RuntimeError("free_group_begin called twice without free_group_end")
        self._in_free_group = True
        self._free_group = []

    def free_group_end(self) -> None:
        self._in_free_group = False
        if self._free_group:
            self.free(torch.cat(self._free_group))
        self._free_group = []
