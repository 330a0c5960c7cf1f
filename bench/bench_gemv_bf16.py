#!/usr/bin/env python
"""The bf16 block GEMV (kernels/gemv_bf16.py) against oneDNN's prepacked bf16 GEMM (AMX where
present), over every linear weight of a model's layers and its LM head streamed from memory,
per row count: where PackedLinear's BF16_GEMV_MAX_ROWS should sit.

    python bench/bench_gemv_bf16.py                     # default SmolLM2 (GGUF Q4_1, Q8_0 head)
    python bench/bench_gemv_bf16.py --rows 1,2,4,8,16

Each pass runs the 120 fused layer weights (q/k/v and gate/up concatenated, as the model runs
them) and the head once; a 600 MB buffer is swept between passes so the weights come from
memory, as in a decode step. Both paths alternate in every repeat; it prints the medians and
the ratio blocks / oneDNN (below 1: the block GEMV is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_gemv import model_weights, parse_weight_bench_args, weight_bench_args

from meshlm.scheduler.kernels.gemv import load_gemv_ops
from meshlm.scheduler.kernels.gemv_bf16 import FORMATS, MAX_ROWS, load_gemv_bf16
from meshlm.scheduler.layers.cpu_gemm import PackedLinear
from meshlm.scheduler.model_loader import resolve_model_path

SWEEP_BYTES = 600 << 20  # more than the last-level cache: the next pass reads weights from memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help=f"row counts, each <= {MAX_ROWS}")
    weight_bench_args(ap)
    args = parse_weight_bench_args(ap)
    gemv, blocks_gemv = load_gemv_ops(), load_gemv_bf16()
    path = resolve_model_path(args.model_path)
    weights = model_weights(path, head=True)
    blocks = [gemv.build(w, FORMATS) for w in weights]
    onednn = [PackedLinear(w, None, dtype=torch.bfloat16) for w in weights]
    sweep = torch.empty(SWEEP_BYTES // 4)
    gb_bf16 = sum(w.numel() for w in weights) * 2 / 1e9
    gb_blocks = sum(b.nbytes() for b in blocks) / 1e9
    print(
        f"threads={torch.get_num_threads()}, {len(weights)} weights of {path.name}: "
        f"{gb_bf16 * 1e3:.0f} MB as bf16, {gb_blocks * 1e3:.0f} MB as blocks"
    )
    print(f"{'rows':>4s} {'oneDNN ms':>10s} {'blocks ms':>10s} {'blocks/oneDNN':>14s} {'blocks GB/s':>12s}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {"onednn": [], "blocks": []}
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # the first pass warms up and is dropped
                sweep.add_(1)
                t0 = time.perf_counter()
                for p in onednn:
                    torch.ops.mkldnn._linear_pointwise(xs[p.in_features], p.packed, None, "none", [None], "")
                times["onednn"].append(time.perf_counter() - t0)
                sweep.add_(1)
                t0 = time.perf_counter()
                for b in blocks:
                    blocks_gemv.gemv(xs[b.in_features], b, None)
                times["blocks"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(
            f"{rows:4d} {med['onednn'] * 1e3:10.1f} {med['blocks'] * 1e3:10.1f} "
            f"{med['blocks'] / med['onednn']:14.2f} {gb_blocks / med['blocks']:12.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
