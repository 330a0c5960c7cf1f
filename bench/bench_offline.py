#!/usr/bin/env python
"""Offline throughput: the meshlm engine (continuous batching) vs HF transformers `generate`
(static batches), same model, same dtype, same prompts, measured in one run.

Workloads (random token ids from a fixed seed, EOS ignored so every request produces exactly its
requested number of tokens):
  (a) N prompts of 256 tokens x 128 output tokens;
  (b) N prompts, input lengths uniform in [32, 1024], output lengths uniform in [16, 256].

HF runs the prompts in arrival order in static batches of each --hf-batch-sizes value: inputs are
left-padded to the longest prompt in the batch and the batch decodes until its longest requested
output (min_new_tokens = max_new_tokens, so nobody stops early). Useful throughput counts only the
requested output tokens, for both systems. The baseline is HF's best batch size.

Every (system, workload[, batch size]) measurement runs in its own fresh subprocess, so the peak
RSS printed is that process's high-water mark (getrusage ru_maxrss): interpreter + torch + weights
+ (ours) the preallocated KV pool + activations, over load, warm-up and the timed run.

    python bench/bench_offline.py --quick      # smoke run, ~3 min on 2 cores
    python bench/bench_offline.py --threads 1  # full run, 64 prompts: ~75 min on 2 cores

With --json PATH every measurement is written to PATH as soon as it finishes. --device (default
auto: cuda if available, else cpu) places both systems; on CUDA each result also has the process's
peak GPU memory (torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

TARGETS = {"a": 1.5, "b": 2.5}  # ours / HF-best
OVERHEAD_TARGET = 0.15  # share of a decode step outside the model forward, workload (a)
TOKEN_LO = 100  # random ids are drawn from [TOKEN_LO, vocab - TOKEN_LO): no special tokens


# ---- arguments ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16 prompts, (a) 128 in x 32 out, (b) in 32-256 / out 16-64, HF batch sizes 8,16",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per workload (default 64, quick 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths (default 0)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of both systems (default float32)",
    )
    p.add_argument(
        "--hf-batch-sizes", default=None, help="comma-separated HF static batch sizes (default 8,16,32,64; quick 8,16)"
    )
    p.add_argument("--workload", default="both", choices=("a", "b", "both"))
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="engine KV pool in tokens (default: sum of input+output over the workload + 2048)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="engine max running requests (default max(64, num prompts))",
    )
    p.add_argument("--model-path", default=None, help="HF dir or .gguf (default: packaged SmolLM2-135M)")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="device of both systems (default auto: cuda if available, else cpu)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads in every worker (default: torch's; 1 on a busy machine)",
    )
    p.add_argument("--systems", default="ours,hf", help="which systems to run: ours,hf (default both)")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    # internal: run one measurement in this process
    p.add_argument("--_worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    if args.num_prompts is None:
        args.num_prompts = 16 if q else 64
    sizes = args.hf_batch_sizes or ("8,16" if q else "8,16,32,64")
    args.hf_batch_sizes = [int(x) for x in sizes.split(",") if x]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    # (a): fixed lengths; (b): uniform ranges
    args.a_in, args.a_out = (128, 32) if q else (256, 128)
    args.b_in, args.b_out = ((32, 256), (16, 64)) if q else ((32, 1024), (16, 256))
    return args


# ---- workloads ---------------------------------------------------------------------------------
def make_workloads(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    n = args.num_prompts
    out: list[dict[str, Any]] = []

    def ids(rng: random.Random, length: int) -> list[int]:
        return [rng.randrange(TOKEN_LO, vocab - TOKEN_LO) for _ in range(length)]

    if args.workload in ("a", "both"):
        rng = random.Random(f"a-{args.seed}")
        out.append(
            {
                "name": "a",
                "desc": f"{n} prompts x {args.a_in} in x {args.a_out} out",
                "prompts": [ids(rng, args.a_in) for _ in range(n)],
                "output_lens": [args.a_out] * n,
            }
        )
    if args.workload in ("b", "both"):
        rng = random.Random(f"b-{args.seed}")
        in_lens = [rng.randint(*args.b_in) for _ in range(n)]
        out_lens = [rng.randint(*args.b_out) for _ in range(n)]
        out.append(
            {
                "name": "b",
                "desc": f"{n} prompts, in U[{args.b_in[0]},{args.b_in[1]}] "
                f"(mean {sum(in_lens) / n:.0f}), out U[{args.b_out[0]},{args.b_out[1]}] "
                f"(mean {sum(out_lens) / n:.0f})",
                "prompts": [ids(rng, k) for k in in_lens],
                "output_lens": out_lens,
            }
        )
    return out


def warmup_prompts(seed: int, vocab: int, count: int, length: int) -> list[list[int]]:
    """Distinct from every timed prompt's stream, so the radix cache gives the timed run nothing."""
    rng = random.Random(f"warmup-{seed}")
    return [[rng.randrange(TOKEN_LO, vocab - TOKEN_LO) for _ in range(length)] for _ in range(count)]


# ---- workers (each in its own process) ---------------------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _cpu_s() -> tuple[float, float]:
    """(this process's CPU seconds, the whole machine's busy CPU seconds from /proc/stat)."""
    t = os.times()
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    return t.user + t.system, busy


def _cpu_delta(c0: tuple[float, float], elapsed: float) -> dict[str, float]:
    """Cores this process kept busy, and cores other processes took, over the timed phase."""
    c1 = _cpu_s()
    own, machine = c1[0] - c0[0], c1[1] - c0[1]
    return {"cpu_s": own, "own_cores": own / elapsed, "other_cores": max(machine - own, 0.0) / elapsed}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(device) -> None:
    """Wait for queued GPU work, so wall time covers it (no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_stats(device) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {}
    return {
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / (1 << 20),
        "gpu_name": torch.cuda.get_device_name(device),
    }


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from meshlm.scheduler.engine import Engine

    prompts, out_lens = spec["prompts"], spec["output_lens"]
    t_load = time.perf_counter()
    engine = Engine(
        model_path=spec["model_path"],
        dtype=spec["dtype"],
        device=spec.get("device", "auto"),
        max_total_tokens=spec["max_total_tokens"],
        max_running_requests=spec["max_running_requests"],
        random_seed=spec["seed"],
        load_progress=False,
    )
    load_s = time.perf_counter() - t_load
    try:

        def req(ids: list[int], n: int) -> dict[str, Any]:
            sp = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
            return {"input_ids": ids, "sampling_params": sp}

        # Warm-up: a short prefill + decode at a modest batch size; then drop its cached KV.
        warm = warmup_prompts(spec["seed"], spec["vocab"], min(8, len(prompts)), 32)
        engine.generate_batch_sync([req(w, 8) for w in warm])
        # Right after the last result the loop may still hold the finished batch for one
        # iteration (flush_cache refuses then), so retry briefly.
        for _ in range(100):
            flushed = engine.flush_cache()
            if flushed.success:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"flush_cache after warm-up failed: {flushed.message}")
        rss_before = _rss_mib()

        st = engine.scheduler.stats
        keys = (
            "decode_steps",
            "decode_forward_s",
            "decode_step_s",
            "generation_tokens",
            "num_retracted",
            "prompt_tokens",
            "cached_tokens",
        )
        s0 = {k: getattr(st, k) for k in keys}
        c0, t0 = _cpu_s(), time.perf_counter()
        results = engine.generate_batch_sync([req(p, n) for p, n in zip(prompts, out_lens)])
        elapsed = time.perf_counter() - t0
        cpu = _cpu_delta(c0, elapsed)
        # The last step's stats are recorded after its outputs went out: a control round trip
        # (answered at the top of the next loop iteration) makes sure they are in.
        engine.get_load()
        s1 = {k: getattr(st, k) for k in keys}
        d = {k: s1[k] - s0[k] for k in keys}
        got = [len(r["output_ids"]) for r in results]
        bad = [(i, g, n) for i, (g, n) in enumerate(zip(got, out_lens)) if g != n]
        if bad:
            raise RuntimeError(f"engine produced wrong output lengths (idx, got, want): {bad[:5]}")
        runner = engine.scheduler.tp_worker.model_runner
        return {
            "system": "ours",
            "device": str(runner.device),
            **_gpu_stats(runner.device),
            "elapsed_s": elapsed,
            **cpu,
            "useful_tokens": sum(out_lens),
            "load_s": load_s,
            "decode_steps": d["decode_steps"],
            "decode_forward_s": d["decode_forward_s"],
            "decode_step_s": d["decode_step_s"],
            "decode_tokens": d["generation_tokens"],
            "num_retracted": d["num_retracted"],
            "cached_tokens": d["cached_tokens"],
            "kv_pool_gib": runner.memory_report()["kv_pool_gib"],
            "max_total_tokens": runner.max_total_num_tokens,
            "max_running_requests": runner.max_running_requests,
            "rss_before_mib": rss_before,
            "peak_rss_mib": _peak_rss_mib(),
        }
    finally:
        engine.shutdown()


def worker_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from meshlm.scheduler.model_executor.model_runner import resolve_device
    from meshlm.scheduler.model_loader import resolve_model_path

    dtype = getattr(torch, spec["dtype"])
    device = resolve_device(spec.get("device", "auto"))
    path = str(resolve_model_path(spec["model_path"]))
    t_load = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers 4
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    model.to(device).eval()
    _sync(device)
    load_s = time.perf_counter() - t_load
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    bs = spec["batch_size"]

    def run_batch(prompts: list[list[int]], new: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
                use_cache=True,
            )
        made = out.shape[1] - width
        if made != new:
            raise RuntimeError(f"HF generated {made} tokens, wanted {new}")
        return made * len(prompts)

    warm = warmup_prompts(spec["seed"], spec["vocab"], bs, 32)
    run_batch(warm, 8)
    _sync(device)
    rss_before = _rss_mib()

    prompts, out_lens = spec["prompts"], spec["output_lens"]
    generated = 0
    c0, t0 = _cpu_s(), time.perf_counter()
    for s in range(0, len(prompts), bs):
        generated += run_batch(prompts[s : s + bs], max(out_lens[s : s + bs]))
    _sync(device)
    elapsed = time.perf_counter() - t0
    cpu = _cpu_delta(c0, elapsed)
    batches = [prompts[s : s + bs] for s in range(0, len(prompts), bs)]
    padded_in = sum(max(len(p) for p in b) * len(b) for b in batches)
    return {
        "system": "hf",
        "device": str(device),
        **_gpu_stats(device),
        "batch_size": bs,
        "elapsed_s": elapsed,
        **cpu,
        "useful_tokens": sum(out_lens),
        "load_s": load_s,
        "generated_tokens": generated,
        "input_tokens": sum(len(p) for p in prompts),
        "padded_input_tokens": padded_in,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "rss_before_mib": rss_before,
        "peak_rss_mib": _peak_rss_mib(),
    }


def worker_main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    res = worker_ours(spec) if spec["system"] == "ours" else worker_hf(spec)
    res["torch_threads"] = torch.get_num_threads()
    with open(out_path, "w") as f:
        json.dump(res, f)


# ---- driver ------------------------------------------------------------------------------------
def launch(spec: dict[str, Any], tmp: str) -> dict[str, Any]:
    tag = f"{spec['system']}-{spec['workload']}-{spec.get('batch_size', 'cb')}"
    spec_path = os.path.join(tmp, tag + ".spec.json")
    out_path = os.path.join(tmp, tag + ".out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_worker", spec_path, out_path],
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0 or not os.path.exists(out_path):
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"worker {tag} failed (exit {proc.returncode})")
    with open(out_path) as f:
        res = json.load(f)
    res["process_s"] = time.perf_counter() - t0
    res["tps"] = res["useful_tokens"] / res["elapsed_s"]
    return res


def fmt_row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))


def main() -> None:
    args = parse_args()
    if args._worker:
        return worker_main(*args._worker)

    import torch

    from meshlm.scheduler.model_config import ModelConfig
    from meshlm.scheduler.model_executor.model_runner import resolve_device
    from meshlm.scheduler.model_loader import resolve_model_path

    path = resolve_model_path(args.model_path)
    vocab = ModelConfig.from_path(path, None).vocab_size
    workloads = make_workloads(args, vocab)
    load1 = os.getloadavg()[0]
    device = resolve_device(args.device)
    if device.type == "cuda":
        print(f"device cuda: {torch.cuda.get_device_name(device)}  (CUDA {torch.version.cuda})")
    print(
        f"model {path}  dtype {args.dtype}  torch {torch.__version__}  "
        f"threads {args.threads or torch.get_num_threads()}  cpus {os.cpu_count()}  "
        f"load avg {load1:.2f}"
    )
    print(
        f"seed {args.seed}  HF batch sizes {args.hf_batch_sizes}  (each measurement in a fresh subprocess)\n",
        flush=True,
    )

    base = {
        "model_path": args.model_path,
        "dtype": args.dtype,
        "seed": args.seed,
        "vocab": vocab,
        "threads": args.threads,
        "device": args.device,
    }
    all_res: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_offline_") as tmp:
        for wl in workloads:
            name = wl["name"]
            need = sum(len(p) + n for p, n in zip(wl["prompts"], wl["output_lens"]))
            spec = {**base, "workload": name, "prompts": wl["prompts"], "output_lens": wl["output_lens"]}
            res: dict[str, Any] = {"desc": wl["desc"], "hf": []}
            all_res[name] = res
            if "ours" in args.systems:
                r = launch(
                    {
                        **spec,
                        "system": "ours",
                        "max_total_tokens": args.max_total_tokens or need + 2048,
                        "max_running_requests": args.max_running_requests or max(64, args.num_prompts),
                    },
                    tmp,
                )
                res["ours"] = r
                progress(f"[{name}] ours     ", r, args, all_res)
            if "hf" in args.systems:
                for bs in args.hf_batch_sizes:
                    r = launch({**spec, "system": "hf", "batch_size": bs}, tmp)
                    res["hf"].append(r)
                    progress(f"[{name}] HF bs={bs:<3d}", r, args, all_res)
    total_s = time.perf_counter() - t_start
    report(args, all_res, total_s)
    save(args, all_res)


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


if __name__ == "__main__":
    main()
