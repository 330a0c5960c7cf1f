"""Zeroed KV memory (mem_cache/zeroed_memory.py): buffers read as zeros at once, writes made
while the background thread faults the pages in survive, and the memory is resident when it
is done (as with torch.zeros)."""

from __future__ import annotations

import psutil
import pytest
import torch

from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool
from meshlm.scheduler.mem_cache.zeroed_memory import Populator, can_populate_later, zeroed

CPU = torch.device("cpu")


@pytest.mark.parametrize("lazy", [False, True])
def test_buffers_read_as_zeros(lazy: bool) -> None:
    t = zeroed((1000, 3, 64), torch.bfloat16, CPU, lazy=lazy)
    assert t.shape == (1000, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[7] = 1.5
    assert float(t.sum()) == 1.5 * 3 * 64


@pytest.mark.skipif(not can_populate_later(), reason="no MADV_POPULATE_WRITE on this kernel")
def test_writes_during_population_survive_and_the_memory_becomes_resident() -> None:
    rss0 = psutil.Process().memory_info().rss
    bufs = [zeroed((1 << 20, 4), torch.float32, CPU, lazy=True) for _ in range(16)]  # 16 x 16 MiB
    assert psutil.Process().memory_info().rss - rss0 < 32 << 20  # nothing faulted in yet
    pop = Populator(bufs, "test buffers").start()
    for i, b in enumerate(bufs):  # the engine writing KV while the pages come in
        b[i * 1000 : i * 1000 + 500] = float(i + 1)
    assert pop.done.wait(60)
    for i, b in enumerate(bufs):
        assert float(b.sum()) == (i + 1) * 500 * 4 and float(b[: i * 1000].abs().sum()) == 0
    assert psutil.Process().memory_info().rss - rss0 > 200 << 20  # 256 MiB resident now


def test_the_kv_pool_is_zeroed_and_populated() -> None:
    pool = MHATokenToKVPool(4096, 1, torch.float32, 2, 64, 3)
    assert all(not b.any() for b in pool.k_buffer + pool.v_buffer)
    pool.set_kv_buffer(1, torch.tensor([1, 4095]), torch.ones(2, 2, 64), torch.full((2, 2, 64), 2.0))
    if pool.populator is not None:
        assert pool.populator.done.wait(60)
    k, v = pool.get_kv_buffer(1)
    assert float(k.sum()) == 2 * 2 * 64 and float(v.sum()) == 2 * 2 * 64 * 2
    assert not pool.k_buffer[0].any() and not k[0].any()  # the padding page is zeros
