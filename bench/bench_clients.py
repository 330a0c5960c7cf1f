"""The load generators of bench_vs_vllm.py over one workload: vLLM's own `vllm bench serve`, our
streaming client (bench_online) against either server, the meshlm engine in-process; the checks
every result must pass (all requests done, every output its requested length)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from meshlm.common import event_loop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_online import Result, StreamFn, engine_stream, make_workload, pct, run_level  # noqa: E402
from bench_servers import (
    Server,
    log_tail,
    spawn,
    stop,
    vllm_env,
    wait_cpu_idle,
)

WORKLOADS = ("random", "shared-prefix", "mixed")


Row = dict[str, Any]


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int

    def vllm_args(self) -> list[str]:
        if self.name == "shared-prefix":
            return [
                "--dataset-name",
                "prefix_repetition",
                "--prefix-repetition-prefix-len",
                str(self.input_len),
                "--prefix-repetition-suffix-len",
                str(max(8, self.input_len // 8)),
                "--prefix-repetition-num-prefixes",
                "4",
                "--prefix-repetition-output-len",
                str(self.output_len),
            ]
        ratio = ["--random-range-ratio", "0.75"] if self.name == "mixed" else []
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(self.input_len),
            "--random-output-len",
            str(self.output_len),
            *ratio,
        ]

    def prompts(self, n: int, seed: int) -> list[dict[str, Any]]:
        """The same shapes as text prompts, for bench_online.py's client (the fallback)."""
        if self.name != "mixed":
            return make_workload(
                "random" if self.name == "random" else "shared-prefix", n, seed, self.input_len, self.output_len
            )
        rng, i, o = random.Random(seed), self.input_len, self.output_len
        return [
            make_workload(
                "random", 1, seed + k, rng.randint(i // 4, i * 7 // 4), rng.randint(max(1, o // 4), o * 7 // 4)
            )[0]
            for k in range(n)
        ]

    def seed(self, base: int, c: int, run: int = 1) -> int:
        """Each (workload, concurrency, round) run gets its own prompts, the same for every system:
        both servers keep a prefix cache, and vLLM's random prompts of one seed are the same runs of
        token ids at any length, so a repeated seed would find the previous run's prompts cached.
        `run` is the round, from 1."""
        return base + 1000 * WORKLOADS.index(self.name) + c + 100_000 * (run - 1)

    def describe(self, n: int, n1: int) -> str:
        var = " (+-75%)" if self.name == "mixed" else ""
        what = "4 shared prefixes of" if self.name == "shared-prefix" else "input"
        return f"{what} {self.input_len}{var}, output {self.output_len}{var} tokens, {n} prompts ({n1} at c=1)"


def vllm_bench(args: argparse.Namespace, srv: Server, wl: Workload, n: int, c: int, work: Path, run: int = 1) -> Row:
    """`vllm bench serve` against srv in round `run` (from 1; later rounds name their result files)."""
    tag = f"{srv.label}-{wl.name}-c{c}".replace("[", "-").replace("]", "") + (f"-r{run}" if run > 1 else "")
    argv = [
        str(args.venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        srv.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        srv.model,
        "--tokenizer",
        args.model_path,
        *wl.vllm_args(),
        "--ignore-eos",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--request-rate",
        "inf",
        "--num-warmups",
        str(args.num_warmups),
        "--seed",
        str(wl.seed(args.seed, c, run)),
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(work / "results"),
        "--result-filename",
        tag + ".json",
        "--disable-tqdm",
    ]
    log = work / f"client-{tag}.log"
    p = spawn(argv, vllm_env(work), log)
    try:
        rc = p.wait(timeout=3600)
    finally:
        stop(p)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc}; its log ends:\n{log_tail(log)}")
    d = json.loads((work / "results" / (tag + ".json")).read_text())
    return {
        "client": "vllm bench serve",
        "completed": d["completed"],
        "failed": d.get("failed", 0),
        "total_input_tokens": d["total_input_tokens"],
        "total_output_tokens": d["total_output_tokens"],
        "out_tok_s": d["output_throughput"],
        "tpot_p50_ms": d["median_tpot_ms"],
        "ttft_p50_ms": d["median_ttft_ms"],
        "ttft_p99_ms": d.get("p99_ttft_ms"),
        "itl_p50_ms": d["median_itl_ms"],
        "duration_s": d["duration"],
        "realigned": "re-aligning prompts" in log.read_text(errors="replace"),
    }


def summarize(res: Result, client: str) -> Row:
    row = res.row()
    tpots = sorted((s.latency - s.ttft) / (s.output_tokens - 1) for s in res.samples if s.output_tokens > 1)
    return {
        "client": client,
        "completed": len(res.samples),
        "failed": 0,
        "total_output_tokens": sum(s.output_tokens for s in res.samples),
        "out_tok_s": row["out tok/s"],
        "tpot_p50_ms": 1000 * pct(tpots, 50),
        "ttft_p50_ms": row["ttft p50 ms"],
        "ttft_p99_ms": row["ttft p99 ms"],
        "itl_p50_ms": row["itl p50 ms"],
        "duration_s": res.wall,
    }


class _CompletionCounter(asyncio.Protocol):
    """One streaming /v1/completions request on its own HTTP/1.1 connection, counted as its bytes
    arrive: each SSE event's arrival time and token count, kept in `events` (no task is woken
    per event). `done` resolves when the response has ended (the closing chunk, or the server
    closing the connection), or fails on a status other than 200 or a malformed body."""

    def __init__(self, request: bytes, url: str, done: asyncio.Future[None]) -> None:
        self.request, self.url, self.done = request, url, done
        self.head = b""  # the status line and headers until their blank line
        self.chunked: bool | None = None  # None until the headers are in
        self.raw = b""  # body bytes not yet unframed (chunked transfer encoding)
        self.buf = b""  # unframed body bytes not yet a whole event
        self.events: list[tuple[int, float]] = []
        self.seen = 0  # tokens counted so far

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).write(self.request)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        try:
            if self.chunked is None:
                self.head += data
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, data = self.head[:end], self.head[end + 4 :]
                lines = head.split(b"\r\n")
                if lines[0].split(b" ")[1:2] != [b"200"]:
                    raise RuntimeError(f"{self.url}/v1/completions answered {lines[0]!r}")
                self.chunked = any(
                    ln.lower().startswith(b"transfer-encoding:") and b"chunked" in ln.lower() for ln in lines[1:]
                )
            if self.chunked:
                self.raw += data
                while (eol := self.raw.find(b"\r\n")) >= 0:  # chunk: size line, data, CRLF; size 0 ends it
                    size = int(self.raw[:eol].split(b";")[0], 16)
                    if len(self.raw) < eol + 2 + size + 2:
                        break
                    self.buf += self.raw[eol + 2 : eol + 2 + size]
                    self.raw = self.raw[eol + 2 + size + 2 :]
                    if size == 0:
                        self._count(now)
                        return self._finish(None)
            else:
                self.buf += data
            self._count(now)
        except Exception as e:  # noqa: BLE001 (handed to the request's awaiter)
            self._finish(e)

    def _count(self, now: float) -> None:
        """Counts the whole events in buf: a text chunk is one token; the usage event adds the
        tokens that came without text (completion_tokens past those counted)."""
        while (end := self.buf.find(b"\n\n")) >= 0:  # one SSE event per blank-line-ended block
            event, self.buf = self.buf[:end], self.buf[end + 2 :]
            if not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
                continue
            if b'"usage":' not in event or b'"usage":null' in event or b'"usage": null' in event:
                self.seen += 1  # a text chunk (usage is null or absent)
                self.events.append((1, now))
                continue
            chunk = json.loads(event[5:])
            if chunk.get("choices"):
                self.seen += 1
                self.events.append((1, now))
            elif rest := (chunk.get("usage") or {}).get("completion_tokens", self.seen) - self.seen:
                self.seen += rest
                self.events.append((rest, now))  # tokens that came without text, counted at the end

    def _finish(self, error: Exception | None) -> None:
        if self.done.done():
            return
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self.chunked is None:
            exc = ConnectionError(f"{self.url} closed the connection before answering")
        self._finish(exc)


def usage_stream(srv: Server, timeout_s: float = 600.0) -> StreamFn:
    """bench_online.py's streaming /v1/completions client, counting tokens from usage (its own
    parser counts text chunks, and a token whose text is still held back by the detokenizer
    comes without one).

    Lean on purpose: on a 2-core machine the client shares the cores with the server it measures,
    and the ring / engine ratio charges its CPU to the ring (the in-process engine has no HTTP
    client). So each request is a raw HTTP/1.1 request on its own connection whose SSE events are
    counted and timed in the socket's data callback (_CompletionCounter), and only the usage event
    is parsed as JSON; the stream yields (tokens, arrival time) pairs once the response has ended.
    httpx's line iterator with a json.loads per event cost ~105 us of CPU an output token at c=64,
    asyncio streams with a task step per event 20-25, this 17-18 (`ring_cpu.py`)."""
    url = urlsplit(srv.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80

    async def stream(item: dict[str, Any]) -> AsyncIterator[tuple[int, float]]:
        body = json.dumps(
            {
                "model": srv.model,
                "prompt": item["prompt"],
                "max_tokens": item["max_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body
        )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        async with asyncio.timeout(timeout_s):
            transport, proto = await loop.create_connection(
                lambda: _CompletionCounter(request, srv.url, done), host, port
            )
            try:
                await done
            finally:
                transport.close()
        for event in proto.events:
            yield event

    return stream


def online_bench(srv: Server, work: list[dict[str, Any]], c: int) -> Row:
    """usage_stream at concurrency c after a warm-up of two requests."""

    async def go() -> Result:
        stream = usage_stream(srv)
        await run_level("warmup", stream, work[:2], 2)
        return await run_level("ring", stream, work, c)

    return summarize(event_loop.run(go()), "bench_online (tokens from usage)")


def engine_config(flags: list[str], model_path: str | None = None) -> Any:
    """The in-process Engine's SchedulerConfig from `meshlm launch` flags (the engine's among
    them, the rest ignored): the model path resolved (or `model_path`), no load progress bar."""
    from meshlm.launch.engine_flags import add_engine_flags
    from meshlm.scheduler.config import SchedulerConfig
    from meshlm.scheduler.model_loader import resolve_model_path

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_flags(parser)
    config = SchedulerConfig.from_cli_args(parser.parse_known_args(flags)[0])
    return config.replace(model_path=model_path or str(resolve_model_path(config.model_path)), load_progress=False)


def run_engine(config: Any, work: list[dict[str, Any]], c: int) -> Row:
    from meshlm.scheduler.engine import Engine

    with Engine(config) as engine:

        async def go() -> Result:
            await run_level("warmup", engine_stream(engine), work[:2], 2)
            wait_cpu_idle(time.process_time)  # the KV pool is faulted in by a thread after start-up
            return await run_level("engine", engine_stream(engine), work, c)

        return summarize(event_loop.run(go()), "bench_online (in-process engine)")


def run_engine_process(flags: list[str], model_path: str, work: list[dict[str, Any]], c: int) -> Row:
    """run_engine in a fresh process (this file, --engine-worker): each engine turn starts from a
    clean interpreter, not in the process that has driven the other systems' runs and the engines
    of earlier rounds (their heap, their threads). The engine's config: engine_config(flags)."""
    job = json.dumps({"flags": flags, "model_path": model_path, "work": work, "c": c})
    argv = [sys.executable, __file__, "--engine-worker"]
    done = subprocess.run(argv, input=job, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the engine worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    row: Row = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def _engine_worker() -> None:
    """The child of run_engine_process: the job as JSON on stdin, the Row as the last stdout line."""
    job = json.loads(sys.stdin.read())
    row = run_engine(engine_config(job["flags"], model_path=job["model_path"]), job["work"], job["c"])
    print(json.dumps(row), flush=True)


def check(m: Row, n: int, wl: Workload) -> list[str]:
    issues = [] if m["completed"] == n else [f"completed {m['completed']} of {n} requests"]
    if wl.name != "mixed" and m["total_output_tokens"] != n * wl.output_len:
        issues.append(f"{m['total_output_tokens']} output tokens counted, expected {n} x {wl.output_len}")
    if m.get("realigned"):
        issues.append("the client re-aligned the prompts to the server's tokenizer")
    return issues


if __name__ == "__main__" and sys.argv[1:] == ["--engine-worker"]:
    _engine_worker()
