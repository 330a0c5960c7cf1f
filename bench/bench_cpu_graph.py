#!/usr/bin/env python
"""What the CPU decode plan buys: an engine with it against one with --disable-cpu-graph.

    python bench/bench_cpu_graph.py                         # c = 1, 16, 64; 2 rounds
    python bench/bench_cpu_graph.py --concurrency 16 --rounds 3 --output-len 64

Same workload as profile_engine.py: random token prompts of --input-len, --output-len tokens
each, greedy, EOS ignored, a closed loop of `concurrency` clients over max(concurrency, 16)
prompts (4 at c=1), bf16 unless --dtype. Rounds alternate the two engines (plan first, then
eager, each running every concurrency), so drift on a noisy machine hits both. Prints output
tok/s per round and engine, and the median ratio plan / eager per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from meshlm.scheduler.engine import Engine
from meshlm.scheduler.model_executor.cpu_graph_runner import CpuGraphRunner


def closed_loop(engine: Engine, reqs: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds to serve reqs with at most `concurrency` in flight."""

    async def run() -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(r: dict[str, Any]) -> None:
            async with gate:
                await engine.generate(**r)

        await asyncio.gather(*(one(r) for r in reqs))

    t0 = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - t0


def request(rng: random.Random, vocab: int, n_in: int, n_out: int) -> dict[str, Any]:
    ids = [rng.randrange(100, vocab - 100) for _ in range(n_in)]
    sp = {"temperature": 0.0, "max_new_tokens": n_out, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated closed-loop concurrencies")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-path", default=None, help="HF dir or .gguf (default: packaged SmolLM2-135M)")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tok_s: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for name in ("plan", "eager"):
            engine = Engine(
                model_path=args.model_path,
                dtype=args.dtype,
                random_seed=0,
                load_progress=False,
                max_running_requests=max(64, *levels),
                disable_cpu_graph=name == "eager",
            )
            try:
                runner = engine.scheduler.tp_worker.model_runner
                has_plan = isinstance(runner.graph_runner, CpuGraphRunner)
                if has_plan != (name == "plan"):
                    raise SystemExit(f"the {name} engine {'has' if has_plan else 'lacks'} a decode plan here")
                rng = random.Random(rnd)
                vocab = engine.model_config.vocab_size
                engine.generate_batch_sync([request(rng, vocab, 32, 8) for _ in range(8)])  # warm-up
                for c in levels:
                    n = 4 if c == 1 else max(c, 16)
                    engine.flush_cache()
                    reqs = [request(rng, vocab, args.input_len, args.output_len) for _ in range(n)]
                    wall = closed_loop(engine, reqs, c)
                    rate = n * args.output_len / wall
                    tok_s.setdefault((name, c), []).append(rate)
                    print(f"round {rnd + 1} {name:5s} c={c:<3d} {rate:8.1f} output tok/s ({wall:.1f} s)", flush=True)
            finally:
                engine.shutdown()
    print(f"\n{'c':>4s} {'plan tok/s':>11s} {'eager tok/s':>12s} {'plan / eager':>13s}")
    for c in levels:
        plan, eager = statistics.median(tok_s[("plan", c)]), statistics.median(tok_s[("eager", c)])
        print(f"{c:4d} {plan:11.1f} {eager:12.1f} {plan / eager:12.2f}x")


if __name__ == "__main__":
    main()
