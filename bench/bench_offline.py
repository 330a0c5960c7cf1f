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
import subprocess
import sys
import tempfile
import time
from typing import Any

from offline_report import progress, report, save
from offline_workers import TOKEN_LO, worker_main


# ---- arguments ---------------------------------------------------------------------------------
def _engine_arg(text: str, p: argparse.ArgumentParser) -> tuple[str, Any]:
    """KEY=VALUE -> (key, value as bool / int / float / str)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        p.error(f"--engine-arg wants KEY=VALUE, got {text!r}")
    low = raw.lower()
    if low in ("true", "false"):
        return key, low == "true"
    for cast in (int, float):
        try:
            return key, cast(raw)
        except ValueError:
            pass
    return key, raw


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
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine flag (repeatable), e.g. disable_cuda_graph=true or attention_backend=torch_native",
    )
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
    args.engine_args = dict(_engine_arg(a, p) for a in args.engine_arg)
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
        f"load avg {load1:.2f}" + (f"  engine args {args.engine_args}" if args.engine_args else "")
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
        "engine_args": args.engine_args,
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


if __name__ == "__main__":
    main()
