#!/usr/bin/env python
"""Extend (prefill) attention alone: the CPU backend with its C extend kernel vs the same backend
with SDPA for long segments (what it did before the kernel, and what torch_native does), same
pool, same batch, measured in one run. With `--dtype bfloat16` on a CPU with AMX or AVX512-BF16,
also the bf16 tile extend kernel (csrc/extend_attention_amx.c; its columns say AMX, and on a CPU
without AMX its tiles are software ones) and its ratio SDPA / AMX. `--baseline-rev REV` also
times the kernel under test (the AMX one when it runs, else csrc/extend_attention.c) as it was at
git revision REV, alternating with the current one, and prints current / REV.

Each case is an extend batch of `--batch` requests with `--prompt` new tokens after `--prefix`
cached ones (slots scattered, as after many allocations), over `--layers` layers with SmolLM2-
135M's head layout by default (9 query heads, 3 KV heads, head dim 64). Prints ms per layer, the
kernel's GFLOP/s (causal: the FLOPs of the visible scores only) and the ratio SDPA / kernel.

    python bench/bench_extend_attention.py                  # a few prompt x prefix cases, ~1 min
    python bench/bench_extend_attention.py --batch 8 --prompt 256 --prefix 0 --threads 2
    python bench/bench_extend_attention.py --batch 7 --prompt 256 --prefix 0 512 --baseline-rev HEAD
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from kernel_revs import library_at

from meshlm.scheduler.attention.cpu import CpuAttnBackend
from meshlm.scheduler.attention.cpu_kernel import KernelUnavailable, load_decode_kernel
from meshlm.scheduler.attention.extend_kernel import (
    AMX_SOURCE,
    SOURCE,
    AmxExtendKernel,
    ExtendKernel,
    load_amx_extend_kernel,
    load_extend_kernel,
)
from meshlm.scheduler.layers.radix_attention import RadixAttention
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def build(
    batch: int, prompt: int, prefix: int, layers: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[ForwardBatch, list[RadixAttention]]:
    """An extend batch of `batch` requests of `prefix` cached + `prompt` new tokens each."""
    seq = prefix + prompt
    pool = MHATokenToKVPool(batch * seq + 16, 1, dtype, kv_heads, dim, layers)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape).to(dtype))
    table = ReqToTokenPool(batch, seq + 1)
    slots = (torch.randperm(batch * seq) + 1).view(batch, seq)
    table.req_to_token[1 : batch + 1, :seq] = slots
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=batch,
        input_ids=torch.zeros(batch * prompt, dtype=torch.int64),
        positions=torch.arange(prefix, seq).repeat(batch),
        seq_lens=torch.full((batch,), seq),
        req_pool_indices=torch.arange(1, batch + 1),
        out_cache_loc=slots[:, prefix:].reshape(-1),
        seq_lens_cpu=[seq] * batch,
        extend_prefix_lens_cpu=[prefix] * batch,
        extend_seq_lens_cpu=[prompt] * batch,
        req_to_token_pool=table,
        token_to_kv_pool=pool,
    )
    return fb, [RadixAttention(heads, dim, dim**-0.5, kv_heads, layer) for layer in range(layers)]


def time_pass(backend: CpuAttnBackend, fb: ForwardBatch, attn: list[RadixAttention], repeats: int) -> float:
    """Best-of-`repeats` seconds per layer of a full pass over all layers."""
    t, heads, kv_heads, dim = fb.input_ids.shape[0], attn[0].num_heads, attn[0].num_kv_heads, attn[0].head_dim
    assert fb.token_to_kv_pool is not None
    dt = fb.token_to_kv_pool.dtype
    q, k, v = (torch.randn(t, n, dim).to(dt) for n in (heads, kv_heads, kv_heads))
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        backend.init_forward_metadata(fb)
        t0 = time.perf_counter()
        for layer in attn:
            backend.forward(q, k, v, layer, fb)
        best = min(best, time.perf_counter() - t0)
    return best / len(attn)


def time_against(
    backend: CpuAttnBackend, base: CpuAttnBackend | None, fb: ForwardBatch, attn: list[RadixAttention], repeats: int
) -> tuple[float, float]:
    """time_pass of `backend` and, when given, of `base` (inf without one), three times each,
    alternating so that the machine's drift hits both alike; the best of each."""
    t, t_base = float("inf"), float("inf")
    for _ in range(3 if base is not None else 1):
        t = min(t, time_pass(backend, fb, attn, repeats))
        if base is not None:
            t_base = min(t_base, time_pass(base, fb, attn, repeats))
    return t, t_base


class StorelessAmx(ExtendKernel):
    """An AMX extend library from before meshlm_kv_store_bf16 / meshlm_extend_attention_amx_out,
    called as the backend called it then: the new K/V stored by index_put, a float32 out."""

    SYMBOL, NEEDS, Q_DTYPE = AmxExtendKernel.SYMBOL, AmxExtendKernel.NEEDS, torch.bfloat16
    supports = staticmethod(AmxExtendKernel.supports)

    def store(
        self, k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor
    ) -> None:
        k_buf[loc], v_buf[loc] = k, v

    def __call__(self, q, k_buf, v_buf, req_to_token, segments, scale, out):  # type: ignore[no-untyped-def]
        f32 = out if out.dtype == torch.float32 else torch.empty(out.shape)
        return super().__call__(q, k_buf, v_buf, req_to_token, segments, scale, f32).to(out.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    p.add_argument("--prompt", type=int, nargs="*", default=[256, 1024])
    p.add_argument("--prefix", type=int, nargs="*", default=[0, 512])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="pool and q/k/v dtype")
    p.add_argument("--baseline-rev", help="also time the kernel under test as of this git revision (same run)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decode = load_decode_kernel()
    kernel, sdpa = CpuAttnBackend(decode, load_extend_kernel()), CpuAttnBackend(decode, None)
    amx: CpuAttnBackend | None = None
    if args.dtype == "bfloat16":
        try:
            amx = CpuAttnBackend(decode, None, (), load_amx_extend_kernel())
        except KernelUnavailable as e:
            print(f"no AMX extend kernel: {e}")
    scratch = tempfile.TemporaryDirectory()
    base: CpuAttnBackend | None = None
    if amx is not None and args.baseline_rev:
        lib = library_at(args.baseline_rev, AMX_SOURCE, Path(scratch.name))
        old = AmxExtendKernel(lib) if hasattr(lib, "meshlm_kv_store_bf16") else StorelessAmx(lib)
        base = CpuAttnBackend(decode, None, (), old)  # type: ignore[arg-type]
    base_f32: CpuAttnBackend | None = None
    if amx is None and args.baseline_rev:
        base_f32 = CpuAttnBackend(decode, ExtendKernel(library_at(args.baseline_rev, SOURCE, Path(scratch.name))))
    print(
        f"extend attention, {args.layers} layers, H={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"{args.dtype}, threads {torch.get_num_threads()}"
    )
    head = ("batch", 6), ("prompt", 7), ("prefix", 7), ("SDPA ms/layer", 14), ("kernel ms/layer", 16), ("GFLOP/s", 8)
    amx_head = f" {'AMX ms/layer':>13s} {'GFLOP/s':>8s} {'ratio':>7s}" if amx is not None else ""
    if base is not None:
        amx_head += f" {args.baseline_rev + ' ms/layer':>18s} {'AMX / it':>9s}"
    if base_f32 is not None:
        amx_head += f" {args.baseline_rev + ' ms/layer':>18s} {'kernel / it':>11s}"
    print(" ".join(f"{name:>{w}s}" for name, w in head) + f" {'ratio':>7s}" + amx_head)
    for b in args.batch:
        for n in args.prompt:
            for pre in args.prefix:
                fb, attn = build(
                    b, n, pre, args.layers, args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype)
                )
                t_sdpa = time_pass(sdpa, fb, attn, args.repeats)
                t_kernel, t_old = time_against(kernel, base_f32, fb, attn, args.repeats)
                visible = n * pre + n * (n + 1) / 2  # scores a request's queries see
                flops = 4 * b * args.heads * visible * args.head_dim
                line = (
                    f"{b:>6} {n:>7} {pre:>7} {t_sdpa * 1e3:>14.2f} {t_kernel * 1e3:>16.2f} "
                    f"{flops / t_kernel / 1e9:>8.0f} {t_sdpa / t_kernel:>6.2f}x"
                )
                if amx is not None:
                    t_amx, t_base = time_against(amx, base, fb, attn, args.repeats)
                    line += f" {t_amx * 1e3:>13.2f} {flops / t_amx / 1e9:>8.0f} {t_sdpa / t_amx:>6.2f}x"
                    if base is not None:
                        line += f" {t_base * 1e3:>18.2f} {t_amx / t_base:>8.2f}x"
                if base_f32 is not None:
                    line += f" {t_old * 1e3:>18.2f} {t_kernel / t_old:>10.2f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
