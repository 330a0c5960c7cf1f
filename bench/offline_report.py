"""What bench_offline.py prints and saves: a line per measurement as it finishes, the JSON file,
and the final report (tokens/s, ratios to HF's best batch size against the targets, RSS, cores)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

TARGETS = {"a": 1.5, "b": 2.5}  # ours / HF-best


OVERHEAD_TARGET = 0.15  # share of a decode step outside the model forward, workload (a)


def fmt_row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))


def save(args: argparse.Namespace, all_res: dict[str, dict[str, Any]]) -> None:
    """Write everything measured so far to --json (after every measurement)."""
    if args.json:
        with open(args.json, "w") as f:
            kept = {k: v for k, v in vars(args).items() if k != "_worker"}
            json.dump({"args": kept, "results": all_res}, f, indent=1)


def progress(label: str, r: dict[str, Any], args: argparse.Namespace, all_res: dict[str, dict[str, Any]]) -> None:
    extra = ""
    if r.get("decode_steps"):
        extra = (
            f", decode ovhd {(1 - r['decode_forward_s'] / r['decode_step_s']) * 100:.1f}% "
            f"mean bs {r['decode_tokens'] / r['decode_steps']:.1f}"
        )
    if "peak_gpu_mib" in r:
        extra += f", peak GPU mem {r['peak_gpu_mib']:.0f} MiB"
    print(
        f"{label} {r['tps']:8.1f} tok/s  ({r['elapsed_s']:.1f}s, peak RSS "
        f"{r['peak_rss_mib']:.0f} MiB, cores own {r['own_cores']:.2f} "
        f"others {r['other_cores']:.2f}{extra})",
        flush=True,
    )
    save(args, all_res)


def report(args: argparse.Namespace, all_res: dict[str, dict[str, Any]], total_s: float) -> None:
    w = [22, 9, 9, 9, 10, 9, 10, 6, 7]
    summary: list[list[str]] = []
    for name, res in all_res.items():
        print(f"\n=== workload ({name}): {res['desc']}, ignore_eos, dtype {args.dtype} ===")
        print(
            fmt_row(
                ["system", "useful", "wall s", "tok/s", "vs HF-best", "peak RSS", "RSS@start", "cores", "others"], w
            )
        )
        print(fmt_row(["", "out tok", "", "", "", "MiB", "MiB", "own", "cores"], w))
        hf = res["hf"]
        best = max(hf, key=lambda r: r["tps"]) if hf else None
        ours = res.get("ours")
        rows = [("meshlm (continuous)", ours)] if ours else []
        rows += [(f"HF generate bs={r['batch_size']}", r) for r in hf]
        for label, r in rows:
            rel = f"{r['tps'] / best['tps']:.2f}x" if best else "-"
            print(
                fmt_row(
                    [
                        label,
                        str(r["useful_tokens"]),
                        f"{r['elapsed_s']:.1f}",
                        f"{r['tps']:.1f}",
                        rel,
                        f"{r['peak_rss_mib']:.0f}",
                        f"{r['rss_before_mib']:.0f}",
                        f"{r['own_cores']:.2f}",
                        f"{r['other_cores']:.2f}",
                    ],
                    w,
                )
            )
        for r in hf:
            gen, useful = r["generated_tokens"], r["useful_tokens"]
            pad_in, real_in = r["padded_input_tokens"], r["input_tokens"]
            if gen != useful or pad_in != real_in:
                print(
                    f"  HF bs={r['batch_size']}: generated {gen} tokens for {useful} useful "
                    f"({gen / useful:.2f}x), prefilled {pad_in} padded tokens for {real_in} "
                    f"real ({pad_in / real_in:.2f}x)"
                )
        if hf:
            print(f"  HF attention implementation: {hf[0]['attn_implementation']}")
        ratio = ours["tps"] / best["tps"] if ours and best else None
        overhead = mean_bs = None
        if ours:
            if ours["decode_steps"]:
                overhead = 1 - ours["decode_forward_s"] / ours["decode_step_s"]
                mean_bs = ours["decode_tokens"] / ours["decode_steps"]
                per_step = ours["decode_step_s"] / ours["decode_steps"]
                outside_ms = per_step * overhead * 1e3
                print(
                    f"  ours: {ours['decode_steps']} decode steps, mean decode batch "
                    f"{mean_bs:.1f}, "
                    f"{per_step * 1e3:.1f} ms/step, of which outside the model forward "
                    f"{overhead * 100:.1f}% ({outside_ms:.1f} ms); decode steps "
                    f"{ours['decode_step_s'] / ours['elapsed_s'] * 100:.0f}% of wall"
                )
            print(
                f"  ours: KV pool {ours['max_total_tokens']} tokens "
                f"({ours['kv_pool_gib']:.2f} GiB, preallocated), max_running_requests "
                f"{ours['max_running_requests']}, "
                f"retracted {ours['num_retracted']}, cache hits {ours['cached_tokens']} tokens"
            )
        if ratio is not None:
            tgt = TARGETS[name]
            print(
                f"  ratio ours / HF-best (bs={best['batch_size']}): {ratio:.2f}x   "
                f"target >= {tgt}x  "
                f"{'PASS' if ratio >= tgt else 'MISS'}"
            )
        summary.append(
            [
                f"({name})",
                f"{ours['tps']:.1f}" if ours else "-",
                f"{best['tps']:.1f} @{best['batch_size']}" if best else "-",
                f"{ratio:.2f}x / {TARGETS[name]}x" if ratio is not None else "-",
                f"{overhead * 100:.1f}%" if overhead is not None else "-",
                f"{mean_bs:.1f}" if mean_bs is not None else "-",
                f"{ours['peak_rss_mib']:.0f}" if ours else "-",
                f"{best['peak_rss_mib']:.0f}" if best else "-",
            ]
        )
    runs = [r for res in all_res.values() for r in ([res["ours"]] if "ours" in res else []) + res["hf"]]
    cpus = os.cpu_count() or 1
    # Disturbed: other processes wanted cores this run's torch threads needed.
    hit = [r for r in runs if r["other_cores"] > 0.1 and r["torch_threads"] + r["other_cores"] > cpus + 0.1]
    if hit:
        worst = max(r["other_cores"] for r in hit)
        print(
            f"\nWARNING: in {len(hit)} of {len(runs)} timed runs other processes competed "
            f"for the {cpus} cores (up to {worst:.2f} cores); those numbers are disturbed."
        )
        if max(r["torch_threads"] for r in runs) > 1:
            print(
                "  With 2+ torch threads on a busy machine OpenMP matmuls slow down "
                "several-fold; rerun on a quiet machine or with --threads 1 (applied to both "
                "systems)."
            )
    threads = runs[0]["torch_threads"] if runs else "-"
    device = runs[0].get("device", "cpu") if runs else "-"
    print(
        f"\n=== summary ({'quick' if args.quick else 'full'}, {args.num_prompts} prompts, "
        f"dtype {args.dtype}, device {device}, seed {args.seed}, torch threads {threads}, "
        f"{total_s:.0f}s total) ==="
    )
    sw = [8, 10, 14, 16, 13, 9, 12, 11]
    print(
        fmt_row(
            [
                "workload",
                "ours tok/s",
                "HF-best tok/s",
                "ratio / target",
                "decode ovhd",
                "mean bs",
                "ours RSS MiB",
                "HF RSS MiB",
            ],
            sw,
        )
    )
    for row in summary:
        print(fmt_row(row, sw))
    print(
        f"decode ovhd = 1 - decode_forward_s / decode_step_s (target < "
        f"{OVERHEAD_TARGET * 100:.0f}% on (a)); RSS = peak RSS of the measuring process "
        "(ru_maxrss); RSS@start = after load + warm-up;\ncores own / others = CPU seconds of the "
        "measuring process / of all other processes, per wall second of the timed run"
    )
