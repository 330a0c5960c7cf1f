#!/usr/bin/env python
"""The small-batch GEMV kernels (kernels/gemv.py) and the block GEMM (kernels/gemm_q.py) against
oneDNN's prepacked float32 GEMM, over every linear weight of a model's layers streamed from
memory, per row count.

    python bench/bench_gemv.py                          # default SmolLM2 (GGUF Q4_1)
    python bench/bench_gemv.py --rows 1,4,8 --formats q4_1,f32
    python bench/bench_gemv.py --rows 16,64 --formats q4_1 --repeats 30 --baseline-rev HEAD

For each row count it times one pass over all the layer weights, fused as the model runs them
(q/k/v and gate/up of a layer concatenated: 120 GEMMs, 424 MB as float32 for SmolLM2,
far beyond the caches, as in a decode step) through each GEMV format (rows <= 16), through the
block GEMM (when the weights are GGUF blocks; on an AVX-512 build also its AVX2 form,
`blocks_avx2`) and through oneDNN, interleaved, and prints the
medians and the ratios to oneDNN (below 1: faster than oneDNN). The crossovers are where
kernels/gemv.py's MAX_ROWS and kernels/gemm_q.py's GEMV_MAX_ROWS_BESIDE_GEMM should sit.

`--baseline-rev REV` also times the block GEMM built from csrc/gemm_q.c as it was at git revision
REV (`blocks@REV`), its passes interleaved with the current one's (every other pass in reverse
order), and prints the median of the per-pass ratios current / REV. On these VMs, whose speed
drifts by 10-20% over minutes, the medians against oneDNN move by ~10% between runs; that ratio
moves by a few percent (the same source against itself, 20 repeats: 0.97-1.01).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernel_revs import library_at
from safetensors import safe_open

from meshlm.scheduler.kernels.gemm_q import SOURCE as GEMM_Q_SOURCE
from meshlm.scheduler.kernels.gemm_q import GemmQOps, QPanelWeight, load_gemm_q_ops
from meshlm.scheduler.kernels.gemv import FORMATS, GEMV_MAX_ROWS, load_gemv_ops
from meshlm.scheduler.layers.cpu_gemm import PackedLinear
from meshlm.scheduler.model_loader import resolve_model_path


def fused_groups(names: list[str]) -> list[list[str]]:
    """Weight names grouped as the model runs them: q/k/v and gate/up of a layer concatenated
    (one GEMM each), the others alone."""
    groups: dict[str, list[str]] = {}
    for n in names:
        prefix, _, leaf = n.rpartition(".")[0].rpartition(".")
        fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
        groups.setdefault(f"{prefix}.{fused.get(leaf, leaf)}", []).append(n)
    return list(groups.values())


def weight_bench_args(ap: argparse.ArgumentParser) -> None:
    """The flags every weight benchmark shares: --repeats, --threads, --model-path."""
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per path and row count (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model-path", default=None, help="HF dir or .gguf (default: packaged SmolLM2-135M)")


def parse_weight_bench_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, and set torch's threads when --threads is given."""
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def model_weights(path: Path, head: bool = False) -> list[torch.Tensor]:
    """The model's layer weights in float32, fused as the model runs them (fused_groups), and
    with `head` its LM head (the tied embedding where there is no lm_head) last."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        names = [n for n in keys if ".layers." in n and n.endswith("proj.weight")]
        weights = [torch.cat([f.get_tensor(n).float() for n in group]) for group in fused_groups(names)]
        if head:
            weights.append(
                f.get_tensor("lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight").float()
            )
    return weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", default="1,4,8,12,16,32,64,128,512", help=f"row counts (GEMVs only up to {GEMV_MAX_ROWS})"
    )
    ap.add_argument("--formats", default=",".join(FORMATS), help="GEMV formats to time (those the weights allow)")
    ap.add_argument("--baseline-rev", help="also time the block GEMM as of this git revision, interleaved")
    weight_bench_args(ap)
    args = parse_weight_bench_args(ap)
    ops = load_gemv_ops()
    path = resolve_model_path(args.model_path)
    weights = model_weights(path)
    onednn = [PackedLinear(w, None) for w in weights]
    gemvs = {}
    for fmt in args.formats.split(","):
        built = [ops.build(w, (fmt, "f32")) for w in weights]
        if all(g.format == fmt for g in built):
            gemvs[fmt] = built
        else:
            print(f"{fmt}: not every weight is exactly representable; skipped")
    gemm = load_gemm_q_ops()
    blocks = [QPanelWeight.from_gemv(g) for g in gemvs["q4_1"]] if "q4_1" in gemvs else []
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"threads={torch.get_num_threads()}, {len(weights)} fused layer weights of {path.name} ({mb:.0f} MB float32)")
    # on an AVX-512 build the block GEMM runs 512-bit; its AVX2 form is timed beside it
    block_paths = (["blocks", "blocks_avx2"] if gemm.vector_bits == 512 else ["blocks"]) if blocks else []
    kernels = {"blocks": gemm, "blocks_avx2": gemm}
    base = ""
    scratch = tempfile.TemporaryDirectory()
    if blocks and args.baseline_rev:
        base = f"blocks@{args.baseline_rev}"
        kernels[base] = GemmQOps(library_at(args.baseline_rev, GEMM_Q_SOURCE, Path(scratch.name)))
        block_paths.append(base)
    paths = [*gemvs, *block_paths]
    print(f"{'rows':>4s} {'oneDNN ms':>10s}" + "".join(f" {f + ' ms':>9s} {f + '/oneDNN':>12s}" for f in paths))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        here = [f for f in paths if f in block_paths or rows <= GEMV_MAX_ROWS]
        times: dict[str, list[float]] = {"onednn": [], **{f: [] for f in here}}
        with torch.inference_mode():
            for rep in range(args.repeats + 1):  # the first pass warms up and is dropped
                t0 = time.perf_counter()
                for p in onednn:
                    p(xs[p.in_features])
                times["onednn"].append(time.perf_counter() - t0)
                # every other pass in reverse order: a path's place in the pass weighs ~4% here
                for kind in block_paths if rep % 2 else block_paths[::-1]:
                    t0 = time.perf_counter()
                    for b in blocks:
                        kernels[kind].gemm(xs[b.in_features], b, None, avx2=kind == "blocks_avx2")
                    times[kind].append(time.perf_counter() - t0)
                for fmt, built in gemvs.items():
                    if fmt not in here:
                        continue
                    t0 = time.perf_counter()
                    for g in built:
                        ops.gemv(xs[g.in_features], g, None)
                    times[fmt].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        print(
            f"{rows:4d} {med['onednn']:10.1f}"
            + "".join(
                f" {med[f]:9.1f} {med[f] / med['onednn']:12.2f}" if f in med else f" {'-':>9s} {'-':>12s}"
                for f in paths
            )
            + (f"  blocks / {base}: {pair_ratio(times['blocks'], times[base]):.3f}" if base in times else ""),
            flush=True,
        )


def pair_ratio(new: list[float], old: list[float]) -> float:
    """The median of the per-pass ratios new / old (passes interleaved; the warm-up dropped)."""
    return statistics.median(a / b for a, b in zip(new[1:], old[1:]))


if __name__ == "__main__":
    main()
