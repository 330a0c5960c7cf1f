#!/usr/bin/env python
"""Decode attention alone: the CPU backend's fused C kernel vs the torch_native backend (gather
into a padded copy + SDPA per length bucket), same pool, same batch, measured in one run.

Each case builds a KV pool of `--layers` layers (so one "step" streams every layer's KV from
memory, as a real decode step does, instead of re-reading one layer from cache) with SmolLM2-135M's
head layout by default (9 query heads, 3 KV heads, head dim 64). Prompt slots are contiguous per
request and decode slots interleave across requests, as the allocator hands them out. Prints ms
per layer, the KV bytes read per second, and the ratio torch_native / cpu.

    python bench/bench_attention.py                      # a few batch x context cases, ~1 min
    python bench/bench_attention.py --batch 64 --context 320 --dtype bfloat16
    python bench/bench_attention.py --batch 64 --context 320 --dtype bfloat16 --threads 2 --baseline-rev HEAD~1

`--baseline-rev REV` also builds the kernel as it was at git revision REV and times it on the
same pool in the same run, alternating with the current one, and prints current / baseline.
`--bf16-kv` (with `--dtype float32`) also times the kernel over a bf16 pool of the same layout
with float32 queries and new K/V (`--kv-cache-dtype bfloat16` under a float32 model), alternating
with the float32 pool, and prints bf16 pool / float32 pool.

    python bench/bench_attention.py --batch 16 64 --context 320 1024 --threads 2 --bf16-kv

`--scatter` also times the kernel with the same requests' slots spread over a pool of
`--pool-tokens` slots (the default model's pool on a 24 GiB machine), as a long-running server's
pool leaves them after the radix cache has evicted and reused slots for a while: in random order
one slot at a time, and in contiguous runs of 16, 64 and 256 slots placed at random; each against
the allocator's fresh layout in the same pool, as ratios (bench_kv_aging.py measures the whole
engine).

    python bench/bench_attention.py --batch 64 --context 320 --dtype bfloat16 --threads 2 --scatter
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from kernel_revs import library_at

from meshlm.scheduler.attention.cpu import CpuAttnBackend
from meshlm.scheduler.attention.cpu_kernel import SOURCE, DecodeKernel, load_decode_kernel
from meshlm.scheduler.attention.extend_kernel import load_extend_kernel
from meshlm.scheduler.attention.torch_native import TorchNativeAttnBackend
from meshlm.scheduler.layers.radix_attention import RadixAttention
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def build(
    lens: list[int], decoded: int, layers: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[ForwardBatch, list[RadixAttention]]:
    """A decode batch whose request i has lens[i] tokens: the first lens[i] - decoded contiguous
    (its prompt), the last `decoded` interleaved with the other requests' decode tokens."""
    total = sum(lens)
    pool = MHATokenToKVPool(total + 16, 1, dtype, kv_heads, dim, layers)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape).to(dtype))
    table = ReqToTokenPool(len(lens), max(lens) + 1)
    nxt = 1
    for i, n in enumerate(lens):
        p = n - decoded
        table.req_to_token[i + 1, :p] = torch.arange(nxt, nxt + p)
        nxt += p
    for t in range(decoded):
        for i, n in enumerate(lens):
            table.req_to_token[i + 1, n - decoded + t] = nxt
            nxt += 1
    b = len(lens)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=b,
        input_ids=torch.zeros(b, dtype=torch.int64),
        positions=torch.tensor(lens) - 1,
        seq_lens=torch.tensor(lens),
        req_pool_indices=torch.arange(1, b + 1),
        out_cache_loc=torch.tensor([int(table.req_to_token[i + 1, n - 1]) for i, n in enumerate(lens)]),
        seq_lens_cpu=list(lens),
        req_to_token_pool=table,
        token_to_kv_pool=pool,
    )
    return fb, [RadixAttention(heads, dim, dim**-0.5, kv_heads, layer) for layer in range(layers)]


def time_step(
    backend, fb: ForwardBatch, attn: list[RadixAttention], repeats: int, act: torch.dtype | None = None
) -> float:
    """Best-of-`repeats` seconds per layer of a full pass over all layers; q and the new K/V
    of `act` (default: the pool's dtype)."""
    b, heads, kv_heads, dim = fb.batch_size, attn[0].num_heads, attn[0].num_kv_heads, attn[0].head_dim
    dtype = act or fb.token_to_kv_pool.dtype
    q = torch.randn(b, heads, dim).to(dtype)
    k, v = torch.randn(b, kv_heads, dim).to(dtype), torch.randn(b, kv_heads, dim).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        backend.init_forward_metadata(fb)
        t0 = time.perf_counter()
        for layer in attn:
            backend.forward(q, k, v, layer, fb)
        best = min(best, time.perf_counter() - t0)
    return best / len(attn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="*", default=[8, 64])
    p.add_argument("--context", type=int, nargs="*", default=[320, 1024])
    p.add_argument("--mixed", action="store_true", help="also a batch with lengths uniform in 32..context")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-rev", help="also time the kernel as of this git revision (same run)")
    p.add_argument("--bf16-kv", action="store_true", help="float32: also a bf16 pool under float32 queries")
    p.add_argument("--scatter", action="store_true", help="also the slots scattered over a large pool")
    p.add_argument("--pool-tokens", type=int, default=93206, help="pool size with --scatter")
    args = p.parse_args()
    if args.bf16_kv and args.dtype != "float32":
        p.error("--bf16-kv compares against a float32 pool: use it with --dtype float32")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cpu, ref = CpuAttnBackend(load_decode_kernel(), load_extend_kernel()), TorchNativeAttnBackend()
    scratch = tempfile.TemporaryDirectory()
    base = None
    if args.baseline_rev:
        lib = library_at(args.baseline_rev, SOURCE, Path(scratch.name))
        base = CpuAttnBackend(DecodeKernel(lib), load_extend_kernel())
    elem = torch.empty(0, dtype=dtype).element_size()
    print(
        f"decode attention, {args.layers} layers, H={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"{args.dtype}, threads {args.threads}"
    )
    extra = f" {args.baseline_rev + ' ms/layer':>18} {'cpu / it':>9}" if base else ""
    extra += f" {'bf16 KV ms/layer':>17} {'bf16 / f32':>10}" if args.bf16_kv else ""
    head = f"{'batch':>6} {'context':>10} {'torch ms/layer':>15} {'cpu ms/layer':>13} {'cpu GB/s':>9} {'ratio':>7}"
    print(head + extra)
    cases = [(b, [c] * b, str(c)) for b in args.batch for c in args.context]
    if args.mixed:
        g = torch.Generator().manual_seed(0)
        cases += [
            (b, torch.randint(32, c + 1, (b,), generator=g).tolist(), f"U[32,{c}]")
            for b in args.batch
            for c in args.context
        ]
    for b, lens, label in cases:
        fb, attn = build(lens, min(64, min(lens) - 1), args.layers, args.heads, args.kv_heads, args.head_dim, dtype)
        t_ref = time_step(ref, fb, attn, args.repeats)
        t_cpu, t_base, t_bf16 = float("inf"), float("inf"), float("inf")
        fb16 = None
        if args.bf16_kv:
            fb16, _ = build(
                lens, min(64, min(lens) - 1), args.layers, args.heads, args.kv_heads, args.head_dim, torch.bfloat16
            )
        for _ in range(3 if base or fb16 else 1):  # alternate, so drift hits both kernels alike
            t_cpu = min(t_cpu, time_step(cpu, fb, attn, args.repeats))
            if base:
                t_base = min(t_base, time_step(base, fb, attn, args.repeats))
            if fb16 is not None:
                t_bf16 = min(t_bf16, time_step(cpu, fb16, attn, args.repeats, act=torch.float32))
        gbs = 2 * sum(lens) * args.kv_heads * args.head_dim * elem / t_cpu / 1e9
        row = f"{b:>6} {label:>10} {t_ref * 1e3:>15.2f} {t_cpu * 1e3:>13.2f} {gbs:>9.1f} {t_ref / t_cpu:>6.2f}x"
        if base:
            row += f" {t_base * 1e3:>18.2f} {t_cpu / t_base:>8.2f}x"
        if fb16 is not None:
            row += f" {t_bf16 * 1e3:>17.2f} {t_bf16 / t_cpu:>9.2f}x"
        print(row)
        if args.scatter:
            print_scatter(cpu, fb, attn, lens, args.pool_tokens, args.repeats)


SCATTER_RUNS = {"random": 1, "runs of 16": 16, "runs of 64": 64, "runs of 256": 256}


def print_scatter(
    cpu: CpuAttnBackend, fb: ForwardBatch, attn: list[RadixAttention], lens: list[int], pool_tokens: int, repeats: int
) -> None:
    """The kernel over fb's requests moved into a pool of pool_tokens slots: as laid out by
    build() (slots 1.. as the allocator hands them out fresh), then scattered (SCATTER_RUNS), in
    alternating passes; best of each, and its ratio to the fresh layout."""
    small = fb.token_to_kv_pool
    pool = MHATokenToKVPool(pool_tokens + 1, 1, small.dtype, small.head_num, small.head_dim, small.layer_num)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.normal_()
    fb.token_to_kv_pool = pool
    table = fb.req_to_token_pool.req_to_token
    fresh = table.clone()
    g = torch.Generator().manual_seed(0)
    layouts = {"fresh": fresh}
    for name, run in SCATTER_RUNS.items():
        # Whole runs of `run` consecutive slots, in random order over the pool (slot 0 is padding).
        starts = torch.randperm((pool_tokens - 1) // run, generator=g)[: -(-sum(lens) // run)] * run + 1
        slots = (starts[:, None] + torch.arange(run)).reshape(-1)
        laid = fresh.clone()
        nxt = 0
        for i, n in enumerate(lens):
            laid[i + 1, :n] = slots[nxt : nxt + n]
            nxt += n
        layouts[name] = laid
    best = dict.fromkeys(layouts, float("inf"))
    for _ in range(3):  # alternate, so drift hits every layout alike
        for name, laid in layouts.items():
            table.copy_(laid)
            fb.out_cache_loc = torch.tensor([int(laid[i + 1, n - 1]) for i, n in enumerate(lens)])
            best[name] = min(best[name], time_step(cpu, fb, attn, repeats))
    table.copy_(fresh)
    fb.token_to_kv_pool = small
    print(f"    slots over a {pool_tokens}-slot pool, ms/layer (/ fresh): ", end="")
    print(", ".join(f"{name} {t * 1e3:.3f} ({t / best['fresh']:.2f}x)" for name, t in best.items()))


if __name__ == "__main__":
    main()
