#!/usr/bin/env python
"""The bf16 panel GEMM (kernels/gemm_bf16.py) against oneDNN's prepacked bf16 GEMM, over every
linear weight of a model's layers and its LM head streamed from memory, per row count: decode
batches (a few to 64 rows) and prompt chunks (256-2048).

    python bench/bench_gemm_bf16.py                     # default SmolLM2
    python bench/bench_gemm_bf16.py --rows 8,16,64 --repeats 9

Each pass runs the 120 fused layer weights (q/k/v and gate/up concatenated, as the model runs
them) and the head once, each through a PackedLinear as the model calls it; a 600 MB buffer is
swept between passes so the weights come from memory, as in a decode step. Both paths
alternate in every repeat; it prints the medians, the ratio panels / oneDNN (below 1: the
panel GEMM is faster) and the panel GEMM's weight bytes and FLOPs a second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from bench_gemv import model_weights, parse_weight_bench_args, weight_bench_args

from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.gemm_bf16 import load_gemm_bf16
from meshlm.scheduler.layers.cpu_gemm import PackedLinear
from meshlm.scheduler.model_loader import resolve_model_path

SWEEP_BYTES = 600 << 20  # more than the last-level cache: the next pass reads weights from memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,2048", help="row counts (default 1,4,8,16,32,64,256,2048)")
    weight_bench_args(ap)
    args = parse_weight_bench_args(ap)
    try:
        gemm = load_gemm_bf16()
    except KernelUnavailable as e:
        sys.exit(f"no bf16 panel GEMM on this machine: {e}")
    path = resolve_model_path(args.model_path)
    weights = model_weights(path, head=True)
    paths = {
        "onednn": [PackedLinear(w, None, dtype=torch.bfloat16) for w in weights],
        "panels": [PackedLinear(w, None, dtype=torch.bfloat16, gemm_bf16=gemm) for w in weights],
    }
    assert all(p.panels is not None for p in paths["panels"]), "a weight the panel GEMM cannot take"
    sweep = torch.empty(SWEEP_BYTES // 4)
    params = sum(w.numel() for w in weights)
    mb = params * 2 / 1e6
    print(f"threads={torch.get_num_threads()}, {len(weights)} weights of {path.name}: {mb:.0f} MB as bf16")
    print(f"{'rows':>5s} {'oneDNN ms':>10s} {'panels ms':>10s} {'panels/oneDNN':>14s} {'GB/s':>6s} {'GFLOP/s':>8s}")
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
            f"{rows:5d} {med['onednn'] * 1e3:10.1f} {med['panels'] * 1e3:10.1f} "
            f"{med['panels'] / med['onednn']:14.2f} {params * 2 / med['panels'] / 1e9:6.1f} "
            f"{2 * rows * params / med['panels'] / 1e9:8.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
