"""Extend attention of every backend equals plain causal attention over each request's own cache
positions, for batches mixing one-token segments (a mixed chunk's decode rows), short and long
segments, with and without a cached prefix. The CPU backend sends the short segments through
its C decode kernel and the long ones through its C extend kernel (or SDPA, where that kernel
is absent); both halves must land in the right rows."""

from __future__ import annotations

import random

import pytest
import torch

from meshlm.scheduler.attention.cpu import KERNEL_EXTEND_MAX, CpuAttnBackend, split_extend
from meshlm.scheduler.attention.cpu_kernel import KernelUnavailable, load_decode_kernel
from meshlm.scheduler.attention.extend_kernel import ExtendSegments, load_amx_extend_kernel, load_extend_kernel
from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend
from meshlm.scheduler.layers.radix_attention import RadixAttention
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode

LONG = KERNEL_EXTEND_MAX + 13


def _cpu_backend(with_extend_kernel: bool) -> CpuAttnBackend:
    try:
        return CpuAttnBackend(load_decode_kernel(), load_extend_kernel() if with_extend_kernel else None)
    except KernelUnavailable as e:  # pragma: no cover - the CI machine has gcc
        pytest.skip(f"no C compiler: {e}")


def _extend_batch(segments: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """(fb, pool, table) for requests with (prefix, extend) lengths; the prefixes' K/V are random
    and already in the pool, the extend tokens get fresh slots."""
    rng = random.Random(1)
    total = sum(p + n for p, n in segments)
    pool = MHATokenToKVPool(total + 64, 1, dtype, kv_heads, dim, 1)
    table = ReqToTokenPool(len(segments) + 1, max(p + n for p, n in segments) + 1)
    slots = rng.sample(range(1, total + 64), total)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape))
    out_loc, positions, at = [], [], 0
    for i, (pre, n) in enumerate(segments):
        table.req_to_token[i + 1, : pre + n] = torch.tensor(slots[at : at + pre + n])
        out_loc += slots[at + pre : at + pre + n]
        positions += list(range(pre, pre + n))
        at += pre + n
    t = sum(n for _, n in segments)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(segments),
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.tensor(positions),
        seq_lens=torch.tensor([p + n for p, n in segments]),
        req_pool_indices=torch.arange(1, len(segments) + 1),
        out_cache_loc=torch.tensor(out_loc),
        seq_lens_cpu=[p + n for p, n in segments],
        extend_prefix_lens_cpu=[p for p, _ in segments],
        extend_seq_lens_cpu=[n for _, n in segments],
        req_to_token_pool=table,
        token_to_kv_pool=pool,
    )
    return fb, pool, table


def _reference(q, pool, table, segments, heads, kv_heads, dim) -> torch.Tensor:
    """Token a of request i (absolute position pre + a) attends to its slots 0 .. pre + a."""
    out = torch.empty(q.shape, dtype=torch.float32)
    row = 0
    for i, (pre, n) in enumerate(segments):
        idx = table.req_to_token[i + 1, : pre + n]
        keys = pool.k_buffer[0][idx].float().repeat_interleave(heads // kv_heads, dim=1)
        vals = pool.v_buffer[0][idx].float().repeat_interleave(heads // kv_heads, dim=1)
        for a in range(n):
            seen = pre + a + 1
            scores = torch.einsum("hd,nhd->hn", q[row].float(), keys[:seen]) * dim**-0.5
            out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals[:seen])
            row += 1
    return out


CASES = {
    "mixed chunk": [(40, 1), (0, LONG), (7, 1), (100, 1)],  # decode rows around a fresh prompt
    "short and long with prefixes": [(5, 3), (30, LONG), (0, 2), (12, KERNEL_EXTEND_MAX), (3, KERNEL_EXTEND_MAX + 1)],
    "only short": [(9, 1), (0, 4), (50, 2)],
    "only long": [(0, LONG), (17, LONG)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["torch_native", "cpu", "cpu without extend kernel"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "dtype"), [(9, 3, 64, torch.float32), (4, 4, 32, torch.bfloat16)])
def test_extend_equals_causal_attention(case: str, backend: str, heads: int, kv_heads: int, dim: int, dtype) -> None:
    torch.manual_seed(0)
    segments = CASES[case]
    fb, pool, table = _extend_batch(segments, heads, kv_heads, dim, dtype)
    impl = TorchNativeAttnBackend() if backend == "torch_native" else _cpu_backend(backend == "cpu")
    impl.init_forward_metadata(fb)
    t = sum(n for _, n in segments)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (x.view(t, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    out = impl.forward(q, k, v, RadixAttention(heads, dim, dim**-0.5, kv_heads, 0), fb)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc], k) and torch.equal(pool.v_buffer[0][fb.out_cache_loc], v)
    want = _reference(q, pool, table, segments, heads, kv_heads, dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_split_routes_by_segment_length() -> None:
    segments = [(40, 1), (0, LONG), (7, 3), (2, KERNEL_EXTEND_MAX + 1)]
    fb, _, _ = _extend_batch(segments, 2, 1, 8, torch.float32)
    split = split_extend(fb)
    assert split.kernel is not None and split.kernel_tokens is not None and split.long is not None
    # batch rows: 0 | 1 .. LONG | LONG+1 .. LONG+3 | the last long segment
    assert split.kernel_tokens.tolist() == [0, LONG + 1, LONG + 2, LONG + 3]
    assert split.kernel.rows.tolist() == [1, 3, 3, 3]
    assert split.kernel.lens.tolist() == [41, 8, 9, 10]
    assert split.long_segments == [1, 3]
    assert split.long.rows.tolist() == [2, 4] and split.long.prefix.tolist() == [0, 2]
    assert split.long.starts.tolist() == [1, LONG + 4] and split.long.lens.tolist() == [LONG, KERNEL_EXTEND_MAX + 1]
    only_long, _, _ = _extend_batch([(0, LONG)], 2, 1, 8, torch.float32)
    s = split_extend(only_long)
    assert s.kernel is None and s.long is not None and s.long.lens.tolist() == [LONG]
    only_short, _, _ = _extend_batch([(3, 1), (0, 2)], 2, 1, 8, torch.float32)
    s = split_extend(only_short)
    assert s.kernel_tokens is None and s.long is None and s.long_segments == []


def test_unsupported_head_dim_falls_back_to_sdpa() -> None:
    """A head dim the extend kernel does not take (not a multiple of 16) still attends right."""
    segments = [(3, LONG), (0, 2)]
    fb, pool, table = _extend_batch(segments, 2, 1, 24, torch.float32)
    impl = _cpu_backend(True)
    assert impl.extend_kernel is not None and not impl.extend_kernel.supports(2, 1, 24)
    impl.init_forward_metadata(fb)
    t = sum(n for _, n in segments)
    q, k, v = torch.randn(t, 2, 24), torch.randn(t, 1, 24), torch.randn(t, 1, 24)
    out = impl.forward(q, k, v, RadixAttention(2, 24, 24**-0.5, 1, 0), fb)
    torch.testing.assert_close(out, _reference(q, pool, table, segments, 2, 1, 24), rtol=1e-5, atol=1e-5)


def test_sdpa_kv_dtypes_send_long_segments_to_sdpa() -> None:
    """A pool dtype named in sdpa_kv_dtypes (bf16 where the CPU multiplies it natively) takes SDPA
    for its long segments: the extend kernel is never called, and the result is still right."""
    segments = [(5, LONG), (40, 1)]
    fb, pool, table = _extend_batch(segments, 4, 2, 32, torch.bfloat16)
    base = _cpu_backend(True)
    calls: list[int] = []

    class Spy:
        supports = staticmethod(base.extend_kernel.supports)  # type: ignore[union-attr]

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return base.extend_kernel(*args, **kwargs)  # type: ignore[misc]

    for sdpa_dtypes, want_calls in (((), 1), ((torch.bfloat16,), 0)):
        calls.clear()
        impl = CpuAttnBackend(base.kernel, Spy(), sdpa_dtypes)  # type: ignore[arg-type]
        impl.init_forward_metadata(fb)
        t = sum(n for _, n in segments)
        q, k, v = (torch.randn(t, n, 32, dtype=torch.bfloat16) for n in (4, 2, 2))
        out = impl.forward(q, k, v, RadixAttention(4, 32, 32**-0.5, 2, 0), fb)
        assert len(calls) == want_calls
        want = _reference(q, pool, table, segments, 4, 2, 32)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_auto_backend_sends_bf16_to_sdpa_only_with_amx() -> None:
    from meshlm.scheduler.attention import create_backend
    from meshlm.scheduler.kernels.cpu_features import cpu_has_amx_bf16, cpu_has_native_bf16

    impl = create_backend("auto", torch.device("cpu"))
    if not isinstance(impl, CpuAttnBackend):
        pytest.skip("no C compiler")
    assert (torch.bfloat16 in impl.sdpa_kv_dtypes) == cpu_has_amx_bf16()
    assert torch.float32 not in impl.sdpa_kv_dtypes
    # the bf16 tile kernel runs on AMX tiles or, on AVX512-BF16 alone, on the same program in software
    assert (impl.amx_extend is not None) == cpu_has_native_bf16()


def _amx_backend():
    base = _cpu_backend(True)
    try:
        amx = load_amx_extend_kernel()
    except KernelUnavailable as e:
        pytest.skip(f"no AMX: {e}")
    calls: list[int] = []

    class Spy:
        supports = staticmethod(amx.supports)

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return amx(*args, **kwargs)

        store = staticmethod(amx.store)

    return CpuAttnBackend(base.kernel, base.extend_kernel, (torch.bfloat16,), Spy()), calls  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 128), (4, 4, 32), (4, 1, 96)])
def test_amx_extend_equals_causal_attention(case: str, heads: int, kv_heads: int, dim: int) -> None:
    """With the AMX extend kernel (on a CPU with AMX) a bf16 pool's long segments go through it,
    ahead of SDPA and the float32 kernel, and land in the right rows: queries in blocks of 16
    (short last blocks), keys in blocks of 32 (the causal diagonal inside a block), prefixes,
    GQA groups of 1 to 7 heads. P is rounded to bf16 before the value product, so the tolerance
    is the bf16 one."""
    torch.manual_seed(0)
    segments = CASES[case] + [(0, 33), (31, 16)]
    fb, pool, table = _extend_batch(segments, heads, kv_heads, dim, torch.bfloat16)
    impl, calls = _amx_backend()
    impl.init_forward_metadata(fb)
    t = sum(n for _, n in segments)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
    q, k, v = (x.view(t, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    out = impl.forward(q, k, v, RadixAttention(heads, dim, dim**-0.5, kv_heads, 0), fb)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    # stored by the kernel's C store (bf16 on AMX), in every case
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc], k) and torch.equal(pool.v_buffer[0][fb.out_cache_loc], v)
    want = _reference(q, pool, table, segments, heads, kv_heads, dim)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (14, 2, 128)])
@pytest.mark.parametrize("growth", [0.05, 1.0])
def test_amx_extend_running_max_that_keeps_growing(heads: int, kv_heads: int, dim: int, growth: float) -> None:
    """Scores that rise along the keys (key t is (1 + growth * t) times a common direction the
    queries share): with growth 1 each block of 32 keys raises a query's max by ~32, past the
    lazy threshold, so the output tiles kept in registers (head dims up to 64) are stored,
    rescaled and reloaded on every block; with 0.05 the max creeps up by less and the weights run
    above 1 between rescales. Either way the result is the softmax's (the last keys dominate)."""
    torch.manual_seed(3)
    segments = [(40, 200), (0, 100)]
    fb, pool, table = _extend_batch(segments, heads, kv_heads, dim, torch.bfloat16)
    base = torch.randn(dim).sign() * dim**-0.25  # q . k = sqrt(dim) (1 + growth * t) for k along base
    for i, (pre, n) in enumerate(segments):
        idx = table.req_to_token[i + 1, : pre + n]
        ramp = 1 + growth * torch.arange(pre + n, dtype=torch.float32)
        pool.k_buffer[0][idx] = (ramp[:, None, None] * base + 0.1 * torch.randn(pre + n, kv_heads, dim)).bfloat16()
    impl, calls = _amx_backend()
    impl.init_forward_metadata(fb)
    t = sum(n for _, n in segments)
    q = (base + 0.1 * torch.randn(t, heads, dim)).bfloat16()
    k = pool.k_buffer[0][fb.out_cache_loc].clone()
    v = pool.v_buffer[0][fb.out_cache_loc].clone()
    out = impl.forward(q, k, v, RadixAttention(heads, dim, dim**-0.5, kv_heads, 0), fb)
    assert len(calls) == 1
    want = _reference(q, pool, table, segments, heads, kv_heads, dim)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_amx_extend_rejects_out_of_range_segments() -> None:
    """A slot past the pool, a prefix past the table row or a segment past the batch raises
    IndexError before anything is read; a float32 pool or an unsupported head dim is refused."""
    try:
        amx = load_amx_extend_kernel()
    except KernelUnavailable as e:
        pytest.skip(f"no AMX: {e}")
    fb, pool, table = _extend_batch([(4, 20)], 2, 1, 32, torch.bfloat16)
    q, out = torch.randn(20, 2, 32).bfloat16(), torch.zeros(20, 2, 32)
    k_buf, v_buf = pool.k_buffer[0], pool.v_buffer[0]
    good = ExtendSegments.of([1], [4], [0], [20])
    amx(q, k_buf, v_buf, table.req_to_token, good, 0.2, out)
    past_batch, past_row = (
        ExtendSegments.of([1], [4], [1], [20]),
        ExtendSegments.of([1], [table.req_to_token.shape[1]], [0], [20]),
    )
    for bad in (past_batch, past_row):
        with pytest.raises(IndexError):
            amx(q, k_buf, v_buf, table.req_to_token, bad, 0.2, out)
    table.req_to_token[1, 3] = k_buf.shape[0]
    with pytest.raises(IndexError):
        amx(q, k_buf, v_buf, table.req_to_token, good, 0.2, out)
    assert not amx.supports(2, 1, 80) and amx.supports(2, 1, 32)
    with pytest.raises(ValueError, match="pool dtype"):
        f32 = _extend_batch([(4, 20)], 2, 1, 32, torch.float32)[1]
        amx(q, f32.k_buffer[0], f32.v_buffer[0], table.req_to_token, good, 0.2, out)


@pytest.mark.parametrize("dim", [64, 128])
def test_amx_extend_store_and_bf16_out(dim: int) -> None:
    """AmxExtendKernel.store writes each new K / V row into its slot and nothing else (what
    set_kv_buffer does, bit for bit; k / v views of packed rows), a slot outside the pool raises
    IndexError with nothing written, and a bf16 `out` is the float32 result rounded once."""
    try:
        amx = load_amx_extend_kernel()
    except KernelUnavailable as e:
        pytest.skip(f"no AMX: {e}")
    torch.manual_seed(4)
    segments = [(7, 70), (0, 33)]
    heads, kv_heads = 6, 2
    fb, pool, table = _extend_batch(segments, heads, kv_heads, dim, torch.bfloat16)
    t = sum(n for _, n in segments)
    q = torch.randn(t, heads, dim).bfloat16()
    qkv = torch.randn(t, 2 * kv_heads * dim).bfloat16()
    k, v = (x.view(t, kv_heads, dim) for x in qkv.split([kv_heads * dim, kv_heads * dim], dim=-1))
    loc = fb.out_cache_loc
    k_buf, v_buf = pool.k_buffer[0], pool.v_buffer[0]
    want_k, want_v = k_buf.clone(), v_buf.clone()
    want_k[loc], want_v[loc] = k, v
    amx.store(k_buf, v_buf, k, v, loc)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)
    bad = loc.clone()
    bad[5] = k_buf.shape[0]
    with pytest.raises(IndexError):
        amx.store(k_buf, v_buf, k * 2, v * 2, bad)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)
    segs = ExtendSegments.of([1, 2], [p for p, _ in segments], [0, segments[0][1]], [n for _, n in segments])
    f32 = amx(q, k_buf, v_buf, table.req_to_token, segs, 0.1, torch.empty(t, heads, dim))
    bf16 = amx(q, k_buf, v_buf, table.req_to_token, segs, 0.1, torch.empty(t, heads, dim).bfloat16())
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, f32.bfloat16())
