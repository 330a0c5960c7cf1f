#!/usr/bin/env python
"""Where an in-process engine run spends its time: timers around every linear (by row count),
attention call, fused C op, the LM head and the sampler, split by decode and extend forwards.

    python bench/profile_engine.py                                  # 64 prompts, 256 in / 128 out, all at once
    python bench/profile_engine.py --concurrency 1 --num-prompts 4  # batch-1 decode
    python bench/profile_engine.py --dtype float32 --concurrency 16
    python bench/profile_engine.py --dtype float32 --cpu-graph --kv-cache-dtype bfloat16

Same workload as bench_offline.py's (a): random token prompts, greedy, EOS ignored, a closed
loop of `--concurrency` clients. Prints output tokens/s and, per forward kind and part, the
seconds, the share of the run's wall time, the calls and the time per call. The timers add a
few microseconds a call: compare shares and per-call times, and take the throughput from
bench_offline.py or bench_vs_vllm.py. The CPU decode plan (one C call for a decode step's
kernels) is off by default here, so that every kernel call of a decode step passes a timer;
`--cpu-graph` keeps it on and times its ops in C instead (the plan's timed run: a clock read
around each op), as `plan <kernel>` parts (the block GEMM by its N x K), which is the decode step
the server runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from meshlm.scheduler.attention.cpu import CpuAttnBackend
from meshlm.scheduler.engine import Engine
from meshlm.scheduler.kernels import decode_plan as dp
from meshlm.scheduler.kernels.cpu_ops import CpuOps
from meshlm.scheduler.layers.cpu_gemm import PackedLinear
from meshlm.scheduler.model_executor.model_runner import ModelRunner
from meshlm.scheduler.sampling.sampler import Sampler

HEAD_MIN_OUT = 10_000  # a linear this wide is the LM head


class Timers:
    """Seconds and calls per (forward kind, part); `kind` is set by the wrapped forward."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.kind = "?"

    def wrap(self, cls: type, name: str, part: str | Callable[[tuple[Any, ...]], str]) -> None:
        orig = getattr(cls, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            key = (self.kind, part(args) if callable(part) else part)
            self.seconds[key] += time.perf_counter() - t0
            self.calls[key] += 1
            return out

        setattr(cls, name, timed)

    def wrap_forward(self) -> None:
        orig = ModelRunner.forward

        def forward(runner: ModelRunner, fb: Any) -> Any:
            self.kind = "decode" if fb.forward_mode.is_decode() else "extend"
            t0 = time.perf_counter()
            out = orig(runner, fb)
            self.seconds[(self.kind, "forward (all)")] += time.perf_counter() - t0
            self.calls[(self.kind, "forward (all)")] += 1
            return out

        ModelRunner.forward = forward  # type: ignore[method-assign]

    def wrap_plan(self) -> None:
        """Every decode plan run timed op by op in C, summed per plan part (see plan_parts)."""
        orig = dp.DecodePlan.run
        groups: dict[int, tuple[dp.DecodePlan, list[str], torch.Tensor]] = {}

        def run(plan: dp.DecodePlan, rows: int, op_seconds: torch.Tensor | None = None) -> None:
            if id(plan) not in groups or groups[id(plan)][0] is not plan:  # a rebuilt plan
                names = plan_parts(plan)
                index = sorted(set(names))
                groups[id(plan)] = (plan, index, torch.tensor([index.index(n) for n in names]))
            _, index, of_op = groups[id(plan)]
            seconds = torch.zeros(len(plan.ops), dtype=torch.float64)
            orig(plan, rows, seconds)
            ran = torch.zeros(len(index), dtype=torch.float64).index_add_(0, of_op, seconds)
            calls = torch.zeros(len(index), dtype=torch.int64).index_add_(0, of_op, (seconds > 0).long())
            for name, s, n in zip(index, ran.tolist(), calls.tolist()):
                if n:
                    self.seconds[("decode", name)] += s
                    self.calls[("decode", name)] += n

        dp.DecodePlan.run = run  # type: ignore[method-assign]


def plan_parts(plan: dp.DecodePlan) -> list[str]:
    """Each op's part: `plan <kernel>`, the block GEMM's with its weight's N x K."""
    out = []
    for op in plan.ops:
        name = f"plan {dp.KIND_NAMES[op.kind]}"
        out.append(f"{name} {op.args[8]}x{op.args[9]}" if op.kind == dp.GEMM_Q else name)
    return out


def linear_part(args: tuple[Any, ...]) -> str:
    lin, x = args[0], args[1]
    rows = x.numel() // x.shape[-1]
    size = "<= 4 rows" if rows <= 4 else "<= 256 rows" if rows <= 256 else "> 256 rows"
    return f"{'head' if lin.out_features > HEAD_MIN_OUT else 'linear'} {size}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (default auto)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model-path", default=None, help="HF dir or .gguf (default: packaged SmolLM2-135M)")
    ap.add_argument("--cpu-graph", action="store_true", help="keep the CPU decode plan (its ops timed in C)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 (a bf16 pool under a float32 model)")
    args = ap.parse_args()

    timers = Timers()
    timers.wrap(PackedLinear, "__call__", linear_part)
    timers.wrap(CpuAttnBackend, "forward", "attention")
    for op in ("add_rmsnorm", "rope_neox", "silu_mul"):
        timers.wrap(CpuOps, op, op)
    timers.wrap(Sampler, "forward", "sampler")
    timers.wrap_forward()
    if args.cpu_graph:
        timers.wrap_plan()

    engine = Engine(
        model_path=args.model_path,
        dtype=args.dtype,
        random_seed=0,
        load_progress=False,
        max_running_requests=max(64, args.concurrency),
        disable_cpu_graph=not args.cpu_graph,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def request(n_in: int, n_out: int) -> dict[str, Any]:
        ids = [rng.randrange(100, vocab - 100) for _ in range(n_in)]
        return {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n_out, "ignore_eos": True}}

    try:
        engine.generate_batch_sync([request(32, 8) for _ in range(8)])  # warm-up
        for _ in range(100):
            if engine.flush_cache().success:
                break
            time.sleep(0.02)
        timers.seconds.clear()
        timers.calls.clear()
        reqs = [request(args.input_len, args.output_len) for _ in range(args.num_prompts)]

        async def run() -> None:
            gate = asyncio.Semaphore(args.concurrency)

            async def one(r: dict[str, Any]) -> None:
                async with gate:
                    await engine.generate(**r)

            await asyncio.gather(*(one(r) for r in reqs))

        t0 = time.perf_counter()
        asyncio.run(run())
        wall = time.perf_counter() - t0
        dtype = str(engine.scheduler.tp_worker.model_runner.dtype).removeprefix("torch.")
    finally:
        engine.shutdown()
    print(
        f"{dtype}, {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out at concurrency "
        f"{args.concurrency}: {wall:.2f} s, {args.num_prompts * args.output_len / wall:.1f} output tok/s"
    )
    print(f"{'kind':7s} {'part':22s} {'seconds':>8s} {'share':>6s} {'calls':>7s} {'ms/call':>8s}")
    for key in sorted(timers.seconds, key=lambda k: (k[0], -timers.seconds[k])):
        s, n = timers.seconds[key], timers.calls[key]
        print(f"{key[0]:7s} {key[1]:22s} {s:8.2f} {s / wall:6.1%} {n:7d} {1e3 * s / n:8.2f}")


if __name__ == "__main__":
    main()
