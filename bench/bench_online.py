"""Online serving benchmark: streaming clients at fixed concurrency against any
OpenAI-compatible server, and (with --compare) the four-service system against the in-process
engine on the same workload, printed as ratios.

    python bench/bench_online.py --base-url http://127.0.0.1:30000/v1        # any server
    python bench/bench_online.py --compare                                  # launch meshlm + engine

Workloads: `random` (random token prompts) and `shared-prefix` (a long common system prompt +
short distinct questions). Metrics per concurrency: request throughput, output tokens/s,
TTFT and ITL p50/p99 (ITL = gaps between streamed chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Sample:
    ttft: float
    itls: list[float]
    latency: float
    output_tokens: int


@dataclass
class Result:
    label: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0

    def row(self) -> dict[str, float]:
        ttfts = sorted(s.ttft for s in self.samples)
        itls = sorted(x for s in self.samples for x in s.itls) or [0.0]
        toks = sum(s.output_tokens for s in self.samples)
        return {
            "req/s": len(self.samples) / self.wall,
            "out tok/s": toks / self.wall,
            "ttft p50 ms": 1000 * pct(ttfts, 50),
            "ttft p99 ms": 1000 * pct(ttfts, 99),
            "itl p50 ms": 1000 * pct(itls, 50),
            "itl p99 ms": 1000 * pct(itls, 99),
        }


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def make_workload(kind: str, n: int, seed: int, input_len: int, output_len: int) -> list[dict[str, Any]]:
    """Prompts as token-free text so any server can take them; output lengths fixed (ignore_eos)."""
    rng = random.Random(seed)
    words = [
        "alpha",
        "river",
        "stone",
        "cloud",
        "seven",
        "green",
        "music",
        "light",
        "table",
        "north",
        "quiet",
        "paper",
        "ocean",
        "train",
        "bread",
        "smile",
    ]
    if kind == "random":
        return [
            {"prompt": " ".join(rng.choice(words) for _ in range(input_len)), "max_tokens": output_len}
            for _ in range(n)
        ]
    system = " ".join(rng.choice(words) for _ in range(input_len))
    return [
        {"prompt": f"{system}\nQuestion {i}: {' '.join(rng.choice(words) for _ in range(8))}", "max_tokens": output_len}
        for i in range(n)
    ]


# A stream yields the token count of each chunk as it arrives, or (count, perf_counter time) pairs
# when it timed the chunks itself (bench_clients.usage_stream counts them in its socket callback).
StreamFn = Callable[[dict[str, Any]], AsyncIterator[int | tuple[int, float]]]


async def run_level(label: str, stream: StreamFn, work: list[dict[str, Any]], concurrency: int) -> Result:
    """Run every request with at most `concurrency` in flight; each yields token counts per chunk
    (timed here on arrival, or with the time the stream gives)."""
    res = Result(label, concurrency)
    sem = asyncio.Semaphore(concurrency)

    async def one(item: dict[str, Any]) -> None:
        async with sem:
            t0 = time.perf_counter()
            last, first, toks, gaps = t0, None, 0, []
            async for chunk in stream(item):
                n, now = chunk if isinstance(chunk, tuple) else (chunk, time.perf_counter())
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
                toks += n
            res.samples.append(Sample(first or 0.0, gaps, last - t0, toks))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(w) for w in work))
    res.wall = time.perf_counter() - t0
    return res


def openai_stream(client: httpx.AsyncClient, base_url: str, model: str) -> StreamFn:
    async def stream(item: dict[str, Any]) -> AsyncIterator[int]:
        body = {
            "model": model,
            "prompt": item["prompt"],
            "max_tokens": item["max_tokens"],
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with client.stream("POST", base_url + "/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    yield 1  # one chunk per emitted token (stream_interval 1)

    return stream


def engine_stream(engine: Any) -> StreamFn:
    async def stream(item: dict[str, Any]) -> AsyncIterator[int]:
        sp = {"max_new_tokens": item["max_tokens"], "temperature": 0, "ignore_eos": True}
        async for d in engine.generate_stream(item["prompt"], sampling_params=sp):
            if d["output_ids"]:
                yield len(d["output_ids"])

    return stream


def print_table(rows: list[Result], baseline: list[Result] | None = None) -> None:
    keys = list(rows[0].row())
    print(f"{'system':<14}{'conc':>6}" + "".join(f"{k:>14}" for k in keys))
    for r in rows:
        vals = r.row()
        print(f"{r.label:<14}{r.concurrency:>6}" + "".join(f"{vals[k]:>14.2f}" for k in keys))
    if baseline:
        print("\nratios services / engine (throughput: higher is better; TTFT delta in ms)")
        for s, e in zip(rows, baseline):
            sv, ev = s.row(), e.row()
            print(
                f"  conc {s.concurrency:>3}: out tok/s ratio {sv['out tok/s'] / ev['out tok/s']:.3f}   "
                f"p50 TTFT {sv['ttft p50 ms'] - ev['ttft p50 ms']:+.1f} ms   "
                f"p50 ITL ratio {sv['itl p50 ms'] / max(ev['itl p50 ms'], 1e-9):.3f}"
            )


async def bench_openai(base_url: str, work: list[dict[str, Any]], levels: list[int]) -> list[Result]:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(base_url + "/models")).json()["data"][0]["id"]
        stream = openai_stream(client, base_url, model)
        await run_level("warmup", stream, work[:2], 2)
        return [await run_level("services", stream, work, c) for c in levels]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="OpenAI-compatible base URL (…/v1) of a running server")
    ap.add_argument("--compare", action="store_true", help="launch meshlm and compare with the in-process engine")
    ap.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="words per prompt (random) / system prompt")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    work = make_workload(args.workload, args.num_prompts, args.seed, args.input_len, args.output_len)
    if args.base_url:
        print_table(asyncio.run(bench_openai(args.base_url.rstrip("/"), work, levels)))
        return
    if not args.compare:
        ap.error("give --base-url or --compare")
    from bench_servers import pid_cpu_s, wait_cpu_idle

    from meshlm.launch.launcher import LaunchPlan, free_port, launch
    from meshlm.scheduler.engine import Engine
    from meshlm.scheduler.model_loader import resolve_model_path

    model = str(resolve_model_path(None))
    engine_flags = {"max_total_tokens": 40000, "max_running_requests": 128}
    with Engine(model_path=model, load_progress=False, **engine_flags) as engine:

        async def run_engine() -> list[Result]:
            stream = engine_stream(engine)
            await run_level("warmup", stream, work[:2], 2)
            wait_cpu_idle(time.process_time)  # the KV pool is faulted in by a thread after start-up
            return [await run_level("engine", stream, work, c) for c in levels]

        base = asyncio.run(run_engine())
    plan = LaunchPlan(
        model_path=model,
        tokenizer_path=model,
        http_port=free_port(),
        grpc_port=free_port(),
        scheduler_args=("--max-total-tokens", "40000", "--max-running-requests", "128"),
        log_level="warning",
    )
    system = launch(plan)
    try:
        pids = [c.proc.pid for c in system.children if c.proc is not None]
        wait_cpu_idle(lambda: sum(pid_cpu_s(p) for p in pids))  # as the engine: start-up work done first
        services = asyncio.run(bench_openai(system.http_url + "/v1", work, levels))
    finally:
        system.stop()
    print_table(base + services)
    print_table(services, base)


if __name__ == "__main__":
    main()
