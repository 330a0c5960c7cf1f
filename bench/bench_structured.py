"""What structured output costs: output throughput with a json_schema on every request vs the same
requests unconstrained, at one concurrency, in the same in-process engine (the ratio is the
overhead); then grammar compile time per schema, not cached (a fresh compile) and cached (a hit
in the scheduler's compile pool).

    python bench/bench_structured.py                         # 64 requests at c=16, 20 schemas
    python bench/bench_structured.py --num-prompts 8 --concurrency 4 --max-new-tokens 32   # smoke
    python bench/bench_structured.py --grammar-backend llguidance

The two phases do the same work: the constrained phase runs first (tests/structured_schemas.py's
20 bounded schemas round robin, sampled) and records each request's output length; the free phase
then runs the same prompts with the same seeds, ignore_eos and max_new_tokens set to that length, so
both phases prefill the same prompts and decode the same number of tokens per request and the ratio
of their output tokens per second is what the grammar costs (bitmask fill, mask application,
matcher advance, the grammar queue). Each phase runs --repeats times alternating (never two things
timed at once) and the best of each is compared; a warm-up request of each kind comes first
(weights, kernels, the grammar backend's vocabulary).
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


async def closed_loop(engine: Any, reqs: list[dict[str, Any]], concurrency: int) -> tuple[float, list[int]]:
    """Run reqs with `concurrency` in flight; (seconds, output tokens of each request in order)."""
    order = list(enumerate(reqs))[::-1]
    lengths = [0] * len(reqs)

    async def worker() -> None:
        while order:
            i, r = order.pop()
            out = await engine.generate(**r)
            lengths[i] = len(out["output_ids"])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each phase, alternating; best is kept")
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
        constrained = []
        for i in range(args.num_prompts):
            sp = {"temperature": 0.8, "max_new_tokens": args.max_new_tokens, "sampling_seed": i}
            schema = schema_text(SCHEMAS[i % len(SCHEMAS)][1])
            constrained.append(
                {"input_ids": prompts[i % len(prompts)], "sampling_params": {**sp, "json_schema": schema}}
            )
        engine.generate_batch_sync([constrained[0], {**constrained[0], "sampling_params": {"max_new_tokens": 8}}])
        _, lengths = asyncio.run(closed_loop(engine, constrained, args.concurrency))  # the work both phases do
        free = []
        for r, n in zip(constrained, lengths):
            sp = {k: v for k, v in r["sampling_params"].items() if k != "json_schema"}
            free.append(
                {"input_ids": r["input_ids"], "sampling_params": {**sp, "max_new_tokens": n, "ignore_eos": True}}
            )
        best: dict[str, float] = {}
        runs: dict[str, list[float]] = {"none": [], "json_schema": []}
        for _ in range(args.repeats):
            for name, reqs in (("none", free), ("json_schema", constrained)):
                secs, got = asyncio.run(closed_loop(engine, reqs, args.concurrency))
                if name == "none":
                    assert got == lengths, "the free phase must decode the constrained phase's lengths"
                best[name] = min(best.get(name, secs), secs)
                runs[name].append(secs)
        tokens = sum(lengths)
        base = tokens / best["none"]
        print(
            f"\noutput throughput, {args.num_prompts} requests at c={args.concurrency} ({args.grammar_backend}),"
            f" {tokens} output tokens per phase, best of {args.repeats}"
        )
        print(f"{'constraint':<12} {'seconds':>8} {'tok/s':>8} {'ratio':>6}  every run (s)")
        for name in ("none", "json_schema"):
            tps = tokens / best[name]
            each = " ".join(f"{x:.2f}" for x in runs[name])
            print(f"{name:<12} {best[name]:8.2f} {tps:8.2f} {tps / base:6.3f}  {each}")
        overhead = best["json_schema"] / best["none"] - 1
        print(f"overhead of json_schema on every request (time at equal work): {overhead:+.1%} (target <= 10%)")

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
