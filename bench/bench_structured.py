"""What structured output costs: output throughput with a json_schema on every request vs the same
requests unconstrained, at one concurrency, in the same in-process engine (the ratio is the
overhead); then grammar compile time per schema, not cached (a fresh compile) and cached (a hit
in the scheduler's compile pool).

    python bench/bench_structured.py                         # 64 requests at c=16, 20 schemas
    python bench/bench_structured.py --num-prompts 8 --concurrency 4 --max-new-tokens 32   # smoke
    python bench/bench_structured.py --grammar-backend llguidance

Both phases run the same prompts with ignore_eos off and the same max_new_tokens; the
constrained phase uses tests/structured_schemas.py's 20 bounded schemas round robin, so its
outputs are shorter: throughput is output tokens per second of each phase, not requests. Phases
run one after the other (never two things timed at once); the first phase is preceded by a
warm-up request of each kind (weights, kernels, the grammar backend's vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.structured_schemas import SCHEMAS, prompt_for, schema_text  # noqa: E402


async def closed_loop(engine: Any, reqs: list[dict[str, Any]], concurrency: int) -> tuple[float, int, int]:
    """Run reqs with `concurrency` in flight; (seconds, output tokens, finished by length)."""
    queue = list(reqs)
    tokens = lengths = 0

    async def worker() -> None:
        nonlocal tokens, lengths
        while queue:
            r = queue.pop()
            out = await engine.generate(**r)
            tokens += len(out["output_ids"])
            lengths += out["meta_info"]["finish_reason"]["type"] == "length"

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, tokens, lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--grammar-backend", default="xgrammar", choices=("xgrammar", "llguidance"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()

    from meshlm.scheduler.engine import Engine

    engine = Engine(
        model_path=args.model_path, dtype=args.dtype, grammar_backend=args.grammar_backend, load_progress=False
    )
    try:
        prompts = [engine.apply_chat_template([{"role": "user", "content": prompt_for(w)}]) for w, _ in SCHEMAS]
        sp = {"temperature": 0.8, "max_new_tokens": args.max_new_tokens}
        free, constrained = [], []
        for i in range(args.num_prompts):
            ids = prompts[i % len(prompts)]
            seeded = {**sp, "sampling_seed": i}
            free.append({"input_ids": ids, "sampling_params": seeded})
            schema = schema_text(SCHEMAS[i % len(SCHEMAS)][1])
            constrained.append({"input_ids": ids, "sampling_params": {**seeded, "json_schema": schema}})
        engine.generate_batch_sync([free[0], constrained[0]])  # warm-up, and the backend's vocabulary
        rows = []
        for name, reqs in (("none", free), ("json_schema", constrained)):
            secs, tokens, lengths = asyncio.run(closed_loop(engine, reqs, args.concurrency))
            rows.append((name, secs, tokens, tokens / secs, lengths))
        base = rows[0][3]
        print(f"\noutput throughput, {args.num_prompts} requests at c={args.concurrency} ({args.grammar_backend})")
        print(f"{'constraint':<12} {'seconds':>8} {'tokens':>7} {'tok/s':>8} {'ratio':>6} {'by length':>9}")
        for name, secs, tokens, tps, lengths in rows:
            print(f"{name:<12} {secs:8.2f} {tokens:7d} {tps:8.2f} {tps / base:6.3f} {lengths:9d}")
        overhead = 1 - rows[1][3] / base
        print(f"overhead of json_schema on every request: {overhead:+.1%} (target <= 10%)")

        pool = engine.scheduler.parts.grammar.pool
        assert pool is not None
        backend = pool.backend(timeout=120)
        cold, warm = [], []
        for what, schema in SCHEMAS:
            key = ("json", schema_text({**schema, "description": f"bench {what} {time.time_ns()}"}))
            t0 = time.perf_counter()
            backend.compile(key)  # a key never seen: a full compile
            cold.append(time.perf_counter() - t0)
            pool.get(key).result()
            t0 = time.perf_counter()
            pool.get(key).result()  # the compile pool's cache
            warm.append(time.perf_counter() - t0)
        print(f"\ngrammar compile time per schema over {len(SCHEMAS)} schemas ({args.grammar_backend})")
        for name, xs in (("not cached", cold), ("cached", warm)):
            print(
                f"{name:<11} median {statistics.median(xs) * 1e3:8.3f} ms   max {max(xs) * 1e3:8.3f} ms   "
                f"ratio to not cached {statistics.median(xs) / statistics.median(cold):.4f}"
            )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
