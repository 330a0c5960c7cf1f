"""Zero-filled CPU buffers that cost start-up nothing: anonymous mappings, made resident later.

torch.zeros of a 2 GiB KV pool takes about a second on a small machine (a page fault and a
memset per 4 KiB page). A private anonymous mapping reads as zeros from the start (the kernel
guarantees it: an untouched page is the zero page), so the pool is correct at once, and its
pages are faulted in afterwards by a background thread with madvise(MADV_POPULATE_WRITE) (Linux
>= 5.14), which allocates each missing page zeroed and leaves present pages, and so anything
the engine has written meanwhile, untouched: it races with nothing. The memory is resident a
moment after start-up, as with torch.zeros (RSS is flat while serving, and a machine without
the memory fails then, not under load). Where MADV_POPULATE_WRITE is missing, the mapping is
populated at creation (MAP_POPULATE: one call, still faster than torch.zeros); off Linux, or
for a non-CPU device, torch.zeros.

Invariants: every buffer reads as zeros until written; a Populator keeps its buffers alive
until it is done; madvise is called through ctypes, which releases the GIL, so population
never stalls the scheduler loop's Python threads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
_PAGE = mmap.PAGESIZE


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    """libc's madvise if MADV_POPULATE_WRITE works on this kernel, else None."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    probe = mmap.mmap(-1, _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        ok = fn(addr, _PAGE, MADV_POPULATE_WRITE) == 0
    finally:
        probe.close()
    return fn if ok else None


def can_populate_later() -> bool:
    return _madvise() is not None


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, lazy: bool) -> torch.Tensor:
    """A tensor reading as zeros. On CPU an anonymous mapping: populated now unless `lazy`
    (then hand it to a Populator); elsewhere torch.zeros."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not lazy:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=flags)
    except OSError:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping


class Populator:
    """Faults in the pages of `buffers` (lazy `zeroed` tensors) on a daemon thread."""

    def __init__(self, buffers: list[torch.Tensor], what: str) -> None:
        self._buffers = buffers
        self._what = what
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="populate-memory", daemon=True)

    def start(self) -> Populator:
        self._thread.start()
        return self

    def _run(self) -> None:
        fn = _madvise()
        t0 = time.perf_counter()
        try:
            for buf in self._buffers:
                if fn is None or buf.device.type != "cpu" or buf.numel() == 0 or buf.data_ptr() % _PAGE:
                    continue  # not one of our mappings: torch.zeros made it, resident already
                nbytes = buf.numel() * buf.element_size()
                if fn(buf.data_ptr(), nbytes, MADV_POPULATE_WRITE) != 0:
                    log.warning("%s: madvise(MADV_POPULATE_WRITE) failed (errno %d)", self._what, ctypes.get_errno())
                    return
            log.info("%s resident after %.2fs (populated in the background)", self._what, time.perf_counter() - t0)
        finally:
            self._buffers = []
            self.done.set()
