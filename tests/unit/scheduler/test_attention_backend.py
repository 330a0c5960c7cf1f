"""Decode attention of every backend equals plain per-request attention over each request's own
cache positions, whatever the mix of lengths, the GQA grouping, the head dim and the KV dtype:
the torch-native backend over length buckets, and the CPU backend's fused C kernel reading the
pool in place. The torch backend's buckets partition the batch."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from meshlm.scheduler.attention import AttentionBackend, create_backend
from meshlm.scheduler.attention.cpu import CpuAttnBackend
from meshlm.scheduler.attention.cpu_kernel import SOURCE, DecodeKernel, KernelUnavailable, load_decode_kernel
from meshlm.scheduler.attention.extend_kernel import load_extend_kernel
from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend, length_buckets
from meshlm.scheduler.kernels.build import load_library
from meshlm.scheduler.layers.radix_attention import RadixAttention
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def _cpu_backend() -> CpuAttnBackend:
    try:
        return CpuAttnBackend(load_decode_kernel(), load_extend_kernel())
    except KernelUnavailable as e:  # pragma: no cover - the CI machine has gcc
        pytest.skip(f"no C compiler: {e}")


BACKENDS = {"torch_native": TorchNativeAttnBackend, "cpu": _cpu_backend}


@pytest.mark.parametrize("lens", [[5, 3, 9], [700, 5, 300, 40, 1200, 90, 41, 650], [1] * 4 + [2000]])
def test_buckets_partition_rows_and_bound_padding(lens: list[int]) -> None:
    buckets = length_buckets(lens)
    assert sorted(i for b in buckets for i in b) == list(range(len(lens)))
    for b in buckets:
        lo, hi = min(lens[i] for i in b), max(lens[i] for i in b)
        assert hi <= max(lo * 1.25, lo + 64)


def _decode_case(lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, backend: AttentionBackend):
    torch.manual_seed(0)
    rng = random.Random(0)
    size = sum(lens) + 512
    pool = MHATokenToKVPool(size, 1, dtype, kv_heads, dim, 1)
    rows = ReqToTokenPool(len(lens), max(lens) + 1)
    slots = rng.sample(range(1, size + 1), sum(lens))  # scattered, as after many allocations
    start = 0
    for i, n in enumerate(lens):
        rows.req_to_token[i + 1, :n] = torch.tensor(slots[start : start + n])
        start += n
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape))
    b = len(lens)
    new_loc = torch.tensor([int(rows.req_to_token[i + 1, n - 1]) for i, n in enumerate(lens)])
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=b,
        input_ids=torch.zeros(b, dtype=torch.int64),
        positions=torch.tensor(lens) - 1,
        seq_lens=torch.tensor(lens),
        req_pool_indices=torch.arange(1, b + 1),
        out_cache_loc=new_loc,
        seq_lens_cpu=list(lens),
        req_to_token_pool=rows,
        token_to_kv_pool=pool,
    )
    backend.init_forward_metadata(fb)
    layer = RadixAttention(heads, dim, dim**-0.5, kv_heads, 0)
    # q, k, v as the model hands them over: views into one packed qkv row per token.
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (t.view(b, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    out = backend.forward(q, k, v, layer, fb)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(pool.k_buffer[0][new_loc], k) and torch.equal(pool.v_buffer[0][new_loc], v)
    for i, n in enumerate(lens):
        idx = rows.req_to_token[i + 1, :n]
        keys = pool.k_buffer[0][idx].float().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        vals = pool.v_buffer[0][idx].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), keys) * dim**-0.5
        ref = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[i].float(), ref, atol=tol), (i, (out[i].float() - ref).abs().max())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("lens", [[7, 130, 33, 900, 64, 480, 129], [50, 52, 51], [1]])
def test_decode_equals_per_request_attention(backend: str, lens: list[int]) -> None:
    _decode_case(lens, 6, 2, 16, torch.float32, BACKENDS[backend]())


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (16, 2, 64), (14, 2, 128), (4, 1, 80), (2, 2, 8), (64, 32, 160)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_shapes_and_dtypes(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    _decode_case([3, 257, 40, 1], heads, kv_heads, dim, dtype, _cpu_backend())


def test_cpu_kernel_rejects_unsupported_head_layout() -> None:
    kernel = _cpu_backend().kernel
    table = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="unsupported heads/dim"):
        kernel(
            torch.randn(1, 6, 8),
            torch.zeros(4, 4, 8),
            torch.zeros(4, 4, 8),
            table,
            torch.tensor([1]),
            torch.tensor([1]),
            1.0,
        )


@pytest.mark.parametrize("row,length,slot", [(5, 1, 1), (1, 9, 1), (1, 2, 99), (1, 2, -1), (1, 0, 1)])
def test_cpu_kernel_rejects_out_of_range_indices(row: int, length: int, slot: int) -> None:
    """A bad table row, length or KV slot raises IndexError instead of reading out of bounds."""
    kernel = _cpu_backend().kernel
    table = torch.ones(3, 8, dtype=torch.int64)
    table[1, 1] = slot
    k = torch.zeros(16, 2, 8)
    with pytest.raises(IndexError, match="out of range"):
        kernel(torch.randn(1, 4, 8), k, k.clone(), table, torch.tensor([row]), torch.tensor([length]), 1.0)
    ok = kernel(torch.randn(1, 4, 8), k, k.clone(), table, torch.tensor([1]), torch.tensor([1]), 1.0)
    assert ok.shape == (1, 4, 8)


def test_cpu_kernel_store_rejects_a_slot_out_of_range_and_writes_nothing() -> None:
    kernel = _cpu_backend().kernel
    table = torch.ones(3, 8, dtype=torch.int64)
    k = torch.zeros(16, 2, 8)
    new = torch.ones(1, 2, 8)
    for loc in (16, -1):
        with pytest.raises(IndexError, match="out of range"):
            kernel(
                torch.randn(1, 4, 8),
                k,
                k.clone(),
                table,
                torch.tensor([1]),
                torch.tensor([1]),
                1.0,
                new_kv=(new, new, torch.tensor([loc])),
            )
    assert not k.any()
    with pytest.raises(ValueError, match="pool's dtype"):
        kernel(
            torch.randn(1, 4, 8),
            k,
            k.clone(),
            table,
            torch.tensor([1]),
            torch.tensor([1]),
            1.0,
            new_kv=(new.bfloat16(), new.bfloat16(), torch.tensor([1])),
        )


def test_loading_the_kernel_keeps_denormals() -> None:
    """A -ffast-math shared library can switch on flush-to-zero for the whole process at load
    time; the two-step build must not, or torch's own arithmetic changes under the server."""
    _cpu_backend()
    tiny = torch.tensor([1e-39])
    assert (tiny * 1.0).item() != 0.0


def test_create_backend_by_name_and_device() -> None:
    cpu = torch.device("cpu")
    assert isinstance(create_backend("torch_native", cpu), TorchNativeAttnBackend)
    assert isinstance(create_backend("torch_native", torch.device("cuda")), TorchNativeAttnBackend)
    assert isinstance(create_backend("cpu", cpu), CpuAttnBackend)
    with pytest.raises(ValueError, match="needs device cpu"):
        create_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        create_backend("flashinfer", cpu)


def test_auto_on_cuda_is_triton_else_torch_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on CUDA: the Triton kernels when triton imports and a tiny launch works (nothing else
    is allocated before the first forward), torch_native when the launch fails (here: no GPU) or
    triton does not import; triton named explicitly without triton is a start-up error."""
    cuda = torch.device("cuda")
    pytest.importorskip("triton")
    from meshlm.scheduler.attention import triton_backend

    if not torch.cuda.is_available():
        assert triton_backend.triton_unusable(cuda) is not None
        assert isinstance(create_backend("auto", cuda, num_heads=9, head_dim=64), TorchNativeAttnBackend)
    monkeypatch.setattr(triton_backend, "triton_unusable", lambda device: None)
    backend = create_backend("auto", cuda, num_heads=9, head_dim=64)
    assert isinstance(backend, triton_backend.TritonAttnBackend) and backend.supports_cuda_graph
    assert not TorchNativeAttnBackend.supports_cuda_graph
    for name in [m for m in sys.modules if m.startswith("meshlm.scheduler.attention.triton")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert isinstance(create_backend("auto", cuda, num_heads=9, head_dim=64), TorchNativeAttnBackend)
    with pytest.raises(ValueError, match="'triton' is unavailable"):
        create_backend("triton", cuda, num_heads=9, head_dim=64)


def test_auto_falls_back_without_a_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    load_decode_kernel.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    try:
        assert isinstance(create_backend("auto", torch.device("cpu")), TorchNativeAttnBackend)
        with pytest.raises(ValueError, match="attention_backend 'cpu' is unavailable"):
            create_backend("cpu", torch.device("cpu"))
    finally:
        load_decode_kernel.cache_clear()


def _exact_attention(
    q: torch.Tensor, pool: MHATokenToKVPool, table: ReqToTokenPool, lens: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per request: float64 attention over the pool's bf16 K / V, and sum_t p_t |v_t| (the scale
    of an error made by rounding the weights p)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = pool.k_buffer[0].shape[1]
    refs, scales = [], []
    for i, n in enumerate(lens):
        idx = table.req_to_token[i + 1, :n]
        keys = pool.k_buffer[0][idx].double().repeat_interleave(heads // kv_heads, dim=1)
        vals = pool.v_buffer[0][idx].double().repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), keys) * dim**-0.5).softmax(-1)
        refs.append(torch.einsum("hn,nhd->hd", p, vals))
        scales.append(torch.einsum("hn,nhd->hd", p, vals.abs()))
    return refs, scales


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(9, 3, 64), (16, 2, 64), (14, 2, 128), (8, 8, 128), (4, 1, 64), (18, 6, 64)],
)
@pytest.mark.parametrize("consecutive", [True, False])
def test_cpu_kernel_amx_path_within_bf16_weight_rounding(
    heads: int, kv_heads: int, dim: int, consecutive: bool
) -> None:
    """The bf16 path runs on AMX tiles where the CPU has them (H <= 16: scores with Q tiles held
    in tile registers when Hkv * D / 32 <= 6, else reloaded per block, a block's K rows read in
    place when its slots are consecutive, else gathered; values with the weights rounded to bf16)
    and on AVX512-BF16 otherwise (float32 weights). Against float64 attention: the vector path
    within float32 rounding, the AMX path within 2^-8 * sum_t p_t |v_t| (a weight's bf16 rounding
    is at most 2^-9 of it; the model rounds the output to bf16, 2^-9 of it, anyway). Without AMX
    both calls take the vector path (the test still checks the flag changes nothing)."""
    torch.manual_seed(2)
    lens = [1, 5, 16, 17, 300, 64, 33]
    pool = MHATokenToKVPool(sum(lens) + 8, 1, torch.bfloat16, kv_heads, dim, 1)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape) * 2)
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape))
    table = ReqToTokenPool(len(lens) + 1, max(lens) + 1)
    order = torch.arange(sum(lens)) if consecutive else torch.randperm(sum(lens))
    at = 0
    for i, n in enumerate(lens):
        table.req_to_token[i + 1, :n] = order[at : at + n] + 1
        at += n
    q = torch.randn(len(lens), heads, dim).bfloat16()
    args = (pool.k_buffer[0], pool.v_buffer[0], table.req_to_token, torch.arange(1, len(lens) + 1), torch.tensor(lens))
    try:
        lib = load_library(SOURCE)
    except KernelUnavailable as e:  # pragma: no cover - the CI machine has gcc
        pytest.skip(f"no C compiler: {e}")
    with_amx = DecodeKernel(lib, amx=True)(q, *args, dim**-0.5)
    without = DecodeKernel(lib, amx=False)(q, *args, dim**-0.5)
    refs, scales = _exact_attention(q, pool, table, lens)
    for i in range(len(lens)):
        torch.testing.assert_close(without[i].double(), refs[i], rtol=1e-5, atol=1e-5)
        err = (with_amx[i].double() - refs[i]).abs()
        assert (err <= 2**-8 * scales[i] + 1e-6).all(), (i, (err / scales[i]).max())
    only_value = pool.v_buffer[0][table.req_to_token[1, 0]].float()  # request 0 has one key: softmax weight 1
    torch.testing.assert_close(with_amx[0], only_value.repeat_interleave(heads // kv_heads, 0))


def _random_bf16_pool(lens: list[int], kv_heads: int, dim: int) -> tuple[MHATokenToKVPool, ReqToTokenPool]:
    """A one-layer bf16 pool of random K/V, and request i + 1's row of the table holding lens[i]
    distinct slots, scattered (a random permutation of the pool's slots past slot 0)."""
    pool = MHATokenToKVPool(sum(lens) + 8, 1, torch.bfloat16, kv_heads, dim, 1)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape))
    table = ReqToTokenPool(len(lens) + 1, max(lens) + 1)
    perm, at = torch.randperm(sum(lens)) + 1, 0
    for i, n in enumerate(lens):
        table.req_to_token[i + 1, :n] = perm[at : at + n]
        at += n
    return pool, table


@pytest.mark.parametrize("dim", [64, 128, 80])
def test_cpu_kernel_bf16_query_and_output(dim: int) -> None:
    """A bf16 query over a bf16 pool (the AVX512-BF16 dot path where the CPU has it, for D 64 and
    128; the converting path otherwise) gives what a float32 query of the same values gives,
    and out_dtype bf16 is that result rounded once."""
    kernel = _cpu_backend().kernel
    torch.manual_seed(1)
    heads, kv_heads, lens = 6, 2, [5, 300, 33]
    pool, table = _random_bf16_pool(lens, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim).bfloat16()
    args = (pool.k_buffer[0], pool.v_buffer[0], table.req_to_token, torch.arange(1, 4), torch.tensor(lens), dim**-0.5)
    want = kernel(q.float(), *args)
    got = kernel(q, *args)
    assert got.dtype == torch.float32
    # the AMX path rounds the softmax weights to bf16 (see the test above): within 2^-8 of the
    # output's scale there, float32 rounding on the other paths
    vals = pool.v_buffer[0].float().abs().max()
    torch.testing.assert_close(got, want, rtol=0, atol=float(2**-8 * vals) if dim in (64, 128) else 1e-4)
    rounded = kernel(q, *args, out_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
    with pytest.raises(ValueError, match="out_dtype"):
        kernel(q, *args, out_dtype=torch.float16)


@pytest.mark.parametrize("dim", [64, 128, 80])
def test_cpu_kernel_float32_rows_into_a_bf16_pool(dim: int) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: the decode kernel stores float32 K/V
    rounded as Tensor.to rounds, and a float32 query over the bf16 pool (the AVX-512 float32
    path for D 64 and 128, the converting path otherwise) gives bit for bit what it gives over a
    float32 pool holding the same values."""
    kernel = _cpu_backend().kernel
    torch.manual_seed(2)
    heads, kv_heads, lens = 9, 3, [1, 17, 300, 60]
    pool, table = _random_bf16_pool(lens, kv_heads, dim)
    rows, seq = torch.arange(1, len(lens) + 1), torch.tensor(lens)
    loc = table.req_to_token[rows, seq - 1].clone()  # each request's newest token
    new_k, new_v = torch.randn(len(lens), kv_heads, dim), torch.randn(len(lens), kv_heads, dim)
    q = torch.randn(len(lens), heads, dim)
    k_buf, v_buf = pool.k_buffer[0], pool.v_buffer[0]
    got = kernel(q, k_buf, v_buf, table.req_to_token, rows, seq, dim**-0.5, new_kv=(new_k, new_v, loc))
    assert torch.equal(k_buf[loc], new_k.bfloat16()) and torch.equal(v_buf[loc], new_v.bfloat16())
    want = kernel(q, k_buf.float(), v_buf.float(), table.req_to_token, rows, seq, dim**-0.5)
    assert torch.equal(got, want)
    keys = k_buf[table.req_to_token[2, :17]].double().repeat_interleave(heads // kv_heads, dim=1)
    vals = v_buf[table.req_to_token[2, :17]].double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("hd,nhd->hn", q[1].double(), keys) * dim**-0.5
    torch.testing.assert_close(got[1].double(), torch.einsum("hn,nhd->hd", scores.softmax(-1), vals), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="float32 for a bfloat16 pool"):
        kernel(q, k_buf, v_buf, table.req_to_token, rows, seq, 1.0, new_kv=(new_k.half(), new_v.half(), loc))
