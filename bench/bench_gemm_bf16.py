#!/usr/bin/env python
"""Our bf16 GEMM for this CPU against oneDNN's prepacked bf16 GEMM, over every linear weight of
a model's layers and its LM head streamed from memory, per row count: decode batches (a few to
64 rows) and prompt chunks (256-2048). The kernel is the one the model gets here: on a CPU with
AMX the AMX decode GEMM (kernels/gemm_amx.py: batches of up to its max_rows, larger ones stay on
oneDNN, so their ratio is ~1), on one with AVX512-BF16 and no AMX the panel GEMM
(kernels/gemm_bf16.py: every batch); --kernel picks one.

    python bench/bench_gemm_bf16.py                     # default SmolLM2
    python bench/bench_gemm_bf16.py --rows 8,16,64 --repeats 9

Each pass runs the 120 fused layer weights (q/k/v and gate/up concatenated, as the model runs
them) and the head once, each through a PackedLinear as the model calls it; a 600 MB buffer is
swept between passes so the weights come from memory, as in a decode step. Both paths
alternate in every repeat; it prints the medians, the ratio ours / oneDNN (below 1: ours is
faster) and our kernel's weight bytes and FLOPs a second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from bench_gemv import model_weights, parse_weight_bench_args, weight_bench_args

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.cpu_features import cpu_has_amx_bf16
from meshlm.scheduler.kernels.gemm_amx import load_gemm_amx
from meshlm.scheduler.kernels.gemm_bf16 import load_gemm_bf16
from meshlm.scheduler.layers.cpu_gemm import PackedLinear
from meshlm.scheduler.model_loader import resolve_model_path

SWEEP_BYTES = 600 << 20  # more than the last-level cache: the next pass reads weights from memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,2048", help="row counts (default 1,4,8,16,32,64,256,2048)")
    ap.add_argument("--kernel", choices=["auto", "amx", "panels"], default="auto", help="ours (default: this CPU's)")
    weight_bench_args(ap)
    args = parse_weight_bench_args(ap)
    kernel = args.kernel if args.kernel != "auto" else ("amx" if cpu_has_amx_bf16() else "panels")
    try:
        ours = {"gemm_amx": load_gemm_amx()} if kernel == "amx" else {"gemm_bf16": load_gemm_bf16()}
    except KernelUnavailable as e:
        sys.exit(f"no {kernel} GEMM on this machine: {e}")
    path = resolve_model_path(args.model_path)
    weights = model_weights(path, head=True)
    paths = {
        "onednn": [PackedLinear(w, None, dtype=torch.bfloat16) for w in weights],
        "ours": [PackedLinear(w, None, dtype=torch.bfloat16, **ours) for w in weights],
    }
    assert all(p.panels is not None or p.amx is not None for p in paths["ours"]), "a weight our GEMM cannot take"
    sweep = torch.empty(SWEEP_BYTES // 4)
    params = sum(w.numel() for w in weights)
    mb = params * 2 / 1e6
    print(f"threads={torch.get_num_threads()}, {len(weights)} weights of {path.name}: {mb:.0f} MB bf16; ours: {kernel}")
    print(f"{'rows':>5s} {'oneDNN ms':>10s} {'ours ms':>10s} {'ours/oneDNN':>12s} {'GB/s':>6s} {'GFLOP/s':>8s}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {name: [] for name in paths}
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # the first pass warms up and is dropped
                for name, linears in paths.items():
                    sweep.add_(1)
                    t0 = time.perf_counter()
                    for lin in linears:
                        lin(xs[lin.in_features])
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(
            f"{rows:5d} {med['onednn'] * 1e3:10.1f} {med['ours'] * 1e3:10.1f} "
            f"{med['ours'] / med['onednn']:12.2f} {params * 2 / med['ours'] / 1e9:6.1f} "
            f"{2 * rows * params / med['ours'] / 1e9:8.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
