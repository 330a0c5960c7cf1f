#!/usr/bin/env python
"""A long-running server against a fresh one: the same batch through the in-process Engine right
after `flush_cache` (a fresh KV pool: every prompt's slots contiguous) and after the pool has been
filled and churned by earlier batches (the radix cache evicting, freed slots scattered), in
alternating rounds of one process, as ratios.

    python bench/bench_kv_aging.py                         # 3 rounds, 64 x 256 in / 128 out at c=64
    python bench/bench_kv_aging.py --rounds 5 --age-batches 6
    python bench/bench_kv_aging.py --meshlm-args "--page-size 64"

Each round: flush, run one batch (fresh); then `--age-batches` unmeasured batches of new prompts
(without a flush: the radix cache keeps every finished request's KV and evicts the oldest when the
pool runs short, so the free slots end up scattered across the pool), then one measured batch
(aged). Every batch has new random prompts, so nothing is a prefix hit and both measured batches
do the same work. The default pool (~93K tokens for the default model on a 24 GiB machine) fills
after about four batches of 64 x 384 tokens.

What it shows (2-core AMD EPYC Zen 5, bf16, 2026-12-07; these rounds scatter by +-5%): aged / fresh
0.934, 0.893, 0.992 in three rounds with the defaults (median 0.934), and medians of 0.930-0.961 in
three more invocations that tried a fix each (see bench/README.md, "Fifth sitting of 2026-12-07"):
a long-running pool may cost a few percent, not yet pinned down (part of such a gap is the machine
slowing under sustained load: every process then spends more CPU on the same work). A long-running
pool does scatter a new prompt's slots (with --page-size 1, ~1800 slots a run while the pool is
fresh, ~14 once eviction has begun), and the decode-attention kernel reads scattered rows and short
runs slower (`bench_attention.py --scatter`), but pages of 64 slots taken in long runs (~600 slots
a run when aged) left the ratio where it was.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from meshlm.common import event_loop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_clients import engine_config  # noqa: E402
from bench_online import engine_stream, make_workload, run_level  # noqa: E402
from bench_servers import wait_cpu_idle  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--age-batches", type=int, default=5, help="unmeasured batches before each aged run")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="prompt words (random workload)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--meshlm-args", default="", help="engine flags (as `meshlm launch` takes them), one string")
    args = p.parse_args()

    from meshlm.scheduler.engine import Engine

    config = engine_config(shlex.split(args.meshlm_args))
    seed = iter(range(1000, 100000))

    def batch(label: str) -> float:
        work = make_workload("random", args.num_prompts, next(seed), args.input_len, args.output_len)
        res = event_loop.run(run_level(label, stream, work, args.concurrency))
        return sum(x.output_tokens for x in res.samples) / res.wall

    ratios: list[float] = []
    with Engine(config) as engine:
        stream = engine_stream(engine)
        event_loop.run(run_level("warmup", stream, make_workload("random", 2, 0, args.input_len, 8), 2))
        wait_cpu_idle(time.process_time)  # the KV pool is faulted in by a thread after start-up
        for r in range(1, args.rounds + 1):
            engine.flush_cache()
            fresh = batch("fresh")
            for _ in range(args.age_batches):
                batch("ageing")
            aged = batch("aged")
            ratios.append(aged / fresh)
            print(
                f"round {r}: fresh {fresh:.1f} out tok/s, aged {aged:.1f}: aged / fresh {aged / fresh:.3f}", flush=True
            )
    print(f"median aged / fresh over {args.rounds} rounds: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
