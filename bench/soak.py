"""Soak test: N minutes (default 30) of mixed load with client disconnects against `meshlm launch`
(issue 12). Prints every process's RSS over time, and at the end: errors (must be 0), KV leaks
(running requests + used KV tokens on every scheduler once the load stops: must be 0), each
process's RSS growth after warm-up as a ratio to its RSS when warm-up ended (must be ≤ 5%), and
whether a golden request still gives the output it gave before the load.

    python bench/soak.py                       # 30 minutes, launches the system itself
    python bench/soak.py --minutes 1           # smoke
    python bench/soak.py --minutes 60 --concurrency 48 --dp-size 2 --tokenizer-replicas 2

The load, at --concurrency clients: native /generate SSE, OpenAI chat SSE, non-streaming
/generate and public-API gRPC streams, each read to its end or (with --disconnect-prob) left at a
random point: before the response, after the headers or after k chunks (gRPC: the call cancelled).
An error is any other ending: an HTTP error status, an SSE error event, a transport error or a gRPC
error on a request the client did not leave, or a stream without a finish reason. Exit code 0 only
if every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import psutil

from meshlm.launch.launcher import LaunchPlan, System, free_port, launch
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

KINDS = ("native", "native", "chat", "once", "grpc")
PROMPTS = 16
GOLDEN = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the load (default 30)")
    p.add_argument("--warmup-frac", type=float, default=0.2, help="share of the run that is warm-up (default 0.2)")
    p.add_argument("--sample-s", type=float, default=0.0, help="seconds between RSS samples (default: run/30)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-prob", type=float, default=0.3, help="share of requests the client leaves")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens of a request read to its end")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--tokenizer-replicas", type=int, default=2)
    p.add_argument("--detokenizer-replicas", type=int, default=1)
    p.add_argument("--growth-limit", type=float, default=0.05, help="allowed RSS growth after warm-up (0.05 = 5%%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine-args",
        default="--dtype float32 --max-total-tokens 16384 --max-running-requests 96",
        help="flags given to every scheduler",
    )
    return p.parse_args(argv)


@dataclass
class Tally:
    endings: Counter = field(default_factory=Counter)  # (kind, "done" | "left")
    errors: list[str] = field(default_factory=list)

    def error(self, kind: str, message: str) -> None:
        self.endings[(kind, "error")] += 1
        if len(self.errors) < 20:
            self.errors.append(f"{kind}: {message[:300]}")


def native_body(rng: random.Random, n: int, stream: bool, leave: bool) -> dict[str, Any]:
    i = rng.randrange(PROMPTS)
    return {
        "text": f"Request {i}: repeat the number {i} three times.",
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": leave},
        "stream": stream,
    }


async def sse_request(
    c: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], leave_after: int | None, chat: bool
) -> str | None:
    """None when the stream ended properly (or was left), else the error."""
    if leave_after == -1:  # leave before the response arrives
        task = asyncio.ensure_future(c.post(url + path, json=body))
        await asyncio.sleep(random.uniform(0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    chunks, finished = 0, False
    async with c.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if leave_after is not None and chunks >= leave_after:
                return None
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                return None if finished else "stream ended without a finish reason"
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return f"error event: {chunk['error']}"
            chunks += 1
            if chat:
                finished = finished or chunk["choices"][0]["finish_reason"] is not None
            else:
                finished = chunk["meta_info"]["finish_reason"] is not None
    return "stream closed without [DONE]"


async def grpc_request(stub: Any, rng: random.Random, n: int, leave_after: int | None) -> str | None:
    i = rng.randrange(PROMPTS)
    req = tokenizer_pb2.GenerateRequest(
        prompts=[tokenizer_pb2.Prompt(text=f"Request {i}: repeat the number {i} three times.")],
        stream=True,
        sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=leave_after is not None),
    )
    call = stub.Generate(req, timeout=300)
    if leave_after == -1:
        await asyncio.sleep(rng.uniform(0, 0.05))
        call.cancel()
        return None
    k = 0
    async for response in call:
        if leave_after is not None and k >= leave_after:
            call.cancel()
            return None
        k += 1
        if response.finished:
            return None
    return "gRPC stream ended without a finished response"


async def one_request(
    c: httpx.AsyncClient, stubs: list[Any], url: str, rng: random.Random, args: argparse.Namespace, tally: Tally
) -> None:
    kind = rng.choice(KINDS)
    leave = rng.random() < args.disconnect_prob and kind != "once"
    leave_after = rng.choice([-1, 0, *range(1, 9)]) if leave else None
    n = 4 * args.max_new_tokens if leave else args.max_new_tokens
    try:
        if kind == "grpc":
            err = await grpc_request(rng.choice(stubs), rng, n, leave_after)
        elif kind == "once":
            r = await c.post(url + "/generate", json=native_body(rng, n, False, False))
            body = r.json()
            err = None if r.status_code == 200 and "error" not in body else f"HTTP {r.status_code}: {body}"
        elif kind == "chat":
            i = rng.randrange(PROMPTS)
            body = {
                "messages": [{"role": "user", "content": f"Count to {i}."}],
                "max_tokens": n,
                "temperature": 0,
                "stream": True,
                "ignore_eos": leave,
            }
            err = await sse_request(c, url, "/v1/chat/completions", body, leave_after, chat=True)
        else:
            err = await sse_request(c, url, "/generate", native_body(rng, n, True, leave), leave_after, chat=False)
    except (httpx.HTTPError, grpc.aio.AioRpcError, json.JSONDecodeError) as e:
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        tally.error(kind, err)
    else:
        tally.endings[(kind, "left" if leave else "done")] += 1


async def run_load(system: System, args: argparse.Namespace, tally: Tally, stop_at: float) -> None:
    url = system.http_url
    channels = [grpc.aio.insecure_channel(t.address) for t in system.by_component("tokenizer")]
    stubs = [tokenizer_pb2_grpc.TokenizerServiceStub(ch) for ch in channels]
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:

        async def worker(w: int) -> None:
            rng = random.Random(args.seed * 1000 + w)
            while time.monotonic() < stop_at:
                await one_request(c, stubs, url, rng, args, tally)

        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    for ch in channels:
        await ch.close()


def rss_row(system: System) -> dict[str, float]:
    row = {}
    for child in system.children:
        if child.proc is not None and child.proc.poll() is None:
            row[child.name] = psutil.Process(child.proc.pid).memory_info().rss / (1 << 20)
    return row


def scheduler_leaks(url: str, wait_s: float = 30.0) -> tuple[int, list[dict[str, Any]]]:
    """Running requests + used KV tokens summed over the schedulers, after up to wait_s to settle."""
    deadline = time.monotonic() + wait_s
    while True:
        scheds = httpx.get(url + "/get_server_info", timeout=30).json().get("schedulers") or []
        leak = sum(s["num_running_reqs"] + s["num_used_tokens"] for s in scheds)
        if (leak == 0 and scheds) or time.monotonic() > deadline:
            return leak, scheds
        time.sleep(0.5)


def golden(url: str) -> str:
    r = httpx.post(url + "/generate", json=GOLDEN, timeout=120)
    r.raise_for_status()
    return str(r.json()["text"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from meshlm.scheduler.model_loader import resolve_model_path

    model = str(resolve_model_path(args.model))
    plan = LaunchPlan(
        model_path=model,
        tokenizer_path=model,
        http_port=free_port(),
        grpc_port=free_port(),
        dp_size=args.dp_size,
        tokenizer_replicas=args.tokenizer_replicas,
        detokenizer_replicas=args.detokenizer_replicas,
        scheduler_args=tuple(args.engine_args.split()),
        log_level="warning",
    )
    run_s = args.minutes * 60
    sample_s = args.sample_s or max(2.0, run_s / 30)
    print(f"soak: {args.minutes:g} min, concurrency {args.concurrency}, disconnects {args.disconnect_prob:.0%}")
    system = launch(plan, ready_timeout_s=300)
    try:
        before = golden(system.http_url)
        tally = Tally()
        samples: list[tuple[float, dict[str, float]]] = []
        start = time.monotonic()
        stop_at = start + run_s
        loader = threading.Thread(target=lambda: asyncio.run(run_load(system, args, tally, stop_at)), daemon=True)
        loader.start()
        names = [c.name for c in system.children]
        print("t (s)  " + "  ".join(f"{n:>14}" for n in names) + "   requests  errors   (RSS MiB)")
        while loader.is_alive():
            row = rss_row(system)
            samples.append((time.monotonic() - start, row))
            done = sum(tally.endings.values())
            errs = sum(v for (_, e), v in tally.endings.items() if e == "error")
            cells = "  ".join(f"{row.get(n, float('nan')):>14.1f}" for n in names)
            print(f"{samples[-1][0]:>5.0f}  {cells}   {done:>8}  {errs:>6}", flush=True)
            loader.join(timeout=sample_s)
        samples.append((time.monotonic() - start, rss_row(system)))
        leak, scheds = scheduler_leaks(system.http_url)
        after = golden(system.http_url)
    finally:
        system.stop()
    return report(args, tally, samples, run_s, leak, scheds, before == after)


def report(
    args: argparse.Namespace,
    tally: Tally,
    samples: list[tuple[float, dict[str, float]]],
    run_s: float,
    leak: int,
    scheds: list[dict[str, Any]],
    golden_ok: bool,
) -> int:
    warm = [row for t, row in samples if t >= args.warmup_frac * run_s]
    base, last = warm[0] if warm else samples[0][1], samples[-1][1]
    print("\nendings:", dict(sorted((f"{k}/{e}", v) for (k, e), v in tally.endings.items())))
    errors = sum(v for (_, e), v in tally.endings.items() if e == "error")
    for line in tally.errors:
        print("  error:", line)
    at, limit = f"{args.warmup_frac:.0%}", f"{args.growth_limit:.0%}"
    print(f"\nRSS growth after warm-up (ratio to the RSS at {at} of the run; limit {limit}):")
    worst = 0.0
    for name, mib in last.items():
        growth = (mib - base[name]) / base[name] if name in base else float("nan")
        worst = max(worst, growth)
        print(f"  {name:>20}: {base.get(name, float('nan')):8.1f} -> {mib:8.1f} MiB  ({growth:+.1%})")
    kv = [(s.get("scheduler_id"), s["num_running_reqs"], s["num_used_tokens"]) for s in scheds]
    print(f"\nerrors: {errors}   KV leaks (running + used tokens): {leak} {kv}   golden unchanged: {golden_ok}")
    ok = errors == 0 and leak == 0 and golden_ok and worst <= args.growth_limit
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
