"""Start-up time of `meshlm launch`: from the command to a serving system, and where it goes.

    python bench/bench_startup.py                 # 3 warm runs of the default model
    python bench/bench_startup.py --runs 1 --cold # + one run on an empty cache ($MESHLM_CACHE)
    python bench/bench_startup.py -- --dtype float32 --max-total-tokens 12000   # engine flags

Each run starts `python -m meshlm.launch.cli launch --log-level info` as its own process (the
`meshlm` console script runs the same function), polls `GET /health` every 250 ms, waits for the
launcher's "meshlm is serving" line (every service ready), then sends one 1-token /generate
(the first request's extra cost: the first forward) and stops the system with SIGTERM. It prints
per run: the seconds to /health = 200, to "serving", to the first generated token, and the
scheduler's own phase times from its log (imports, model facts, weights, prepack, KV pool,
ready), and each service's ready time as the launcher logs it; then the median of the warm runs.

Baseline (measured in the same run, first): a fresh interpreter doing `import torch`, the floor
of any scheduler start-up; the summary prints start-up / baseline. With `--against REPO` (another
checkout, e.g. the main branch before a change) every warm run is preceded by one of REPO's
code (PYTHONPATH = REPO/services/*, same cache, same flags), and the summary prints the medians
of both and their ratio.

    python bench/bench_startup.py --runs 3 --against /work/main

--cold points MESHLM_CACHE at an empty temporary directory for one extra run first: the GGUF
conversion, the C kernels' compiles and the GEMV block cache are redone, and their log lines
(what is compiled, how long it took) are printed. The machine should be otherwise idle: every
service start competes for the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

# (label, pattern of a log line, group holding seconds)
PHASES = (
    ("imports", re.compile(r"interpreter and imports took ([\d.]+)s")),
    ("facts", re.compile(r"model facts \(config, tokenizer\) of .* in ([\d.]+)s")),
    ("weights", re.compile(r"model_runner: loaded .* in ([\d.]+)s")),
    ("prepack", re.compile(r"prepacked \d+ linear weights (?:for oneDNN )?in ([\d.]+)s")),
    ("kv_pool", re.compile(r"KV pool: .* in ([\d.]+)s")),
    ("sched_ready", re.compile(r"ready in ([\d.]+)s after the process started")),
)
READY = re.compile(r"launch.launcher: (\S+) ready after ([\d.]+)s")
COLD_NOTES = re.compile(r"compil|Convert|converted|GEMV blocks", re.IGNORECASE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def import_torch_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def _http(url: str, body: dict | None = None, timeout: float = 2.0) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback)
            r.read()
            return int(r.status)
    except (OSError, ValueError):
        return 0


def one_run(engine_args: list[str], env: dict[str, str], timeout_s: float) -> dict:
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "meshlm.launch.cli", "launch", "--port", str(port)]
    argv += ["--grpc-port", str(grpc_port), "--log-level", "info", *engine_args]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    serving = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))
            if line.startswith("meshlm is serving"):
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out: dict = {}
    base = f"http://127.0.0.1:{port}"
    try:
        while "health" not in out:
            if proc.poll() is not None:
                tail = "\n".join(line for _, line in lines[-30:])
                raise RuntimeError(f"meshlm launch exited with {proc.returncode}:\n{tail}")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"no /health = 200 within {timeout_s:.0f}s")
            if _http(base + "/health", timeout=1.0) == 200:
                out["health"] = time.perf_counter() - t0
            else:
                time.sleep(0.25)
        if not serving.wait(max(1.0, timeout_s - (time.perf_counter() - t0))):
            raise TimeoutError("the launcher never said it is serving")
        out["serving"] = next(t for t, line in lines if line.startswith("meshlm is serving"))
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if _http(base + "/generate", body, timeout=120.0) != 200:
            raise RuntimeError("the first /generate failed")
        out["first_token"] = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    text = [line for _, line in lines]
    for label, pattern in PHASES:
        for line in text:
            m = pattern.search(line)
            if m:
                out[label] = float(m.group(1))
                break
    out["ready"] = {m.group(1): float(m.group(2)) for m in (READY.search(line) for line in text) if m}
    out["cold_notes"] = [line for line in text if COLD_NOTES.search(line) and "it/s]" not in line]  # no tqdm bars
    out["log"] = [f"{t:8.3f} {line}" for t, line in lines]
    return out


COLUMNS = ("health", "serving", "first_token") + tuple(label for label, _ in PHASES)


def print_run(name: str, r: dict) -> None:
    cells = "  ".join(f"{r[c]:>8.2f}" if c in r else f"{'-':>8}" for c in COLUMNS)
    ready = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["ready"].items(), key=lambda kv: kv[1]))
    print(f"{name:<8}{cells}   ready after: {ready}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="warm runs (default: 3)")
    p.add_argument("--cold", action="store_true", help="one extra run first on an empty $MESHLM_CACHE")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run (default: 600)")
    p.add_argument("--against", default=None, help="another checkout: alternate warm runs of its code (the baseline)")
    p.add_argument("--log", default=None, help="write the last run's console output (every service's log) here")
    p.add_argument("engine_args", nargs="*", help="flags for `meshlm launch` (after --)")
    args = p.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    baseline = import_torch_s()
    print(f"baseline: a fresh interpreter importing torch takes {baseline:.2f}s", flush=True)
    print(f"{'run':<8}" + "  ".join(f"{c:>8}" for c in ("health", "serving", "1st tok")), end="")
    print("  " + "  ".join(f"{label:>8}"[-8:] for label, _ in PHASES) + "   (seconds)")
    if args.cold:
        cache = tempfile.mkdtemp(prefix="meshlm-cold-cache-")
        try:
            cold = one_run(args.engine_args, {**env, "MESHLM_CACHE": cache}, args.timeout_s)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print_run("cold", cold)
        for line in cold["cold_notes"]:
            print(f"    {line}")
    warm, base = [], []
    base_env = None
    if args.against:
        services = os.path.join(args.against, "services")
        paths = [os.path.join(services, d) for d in ("common", "scheduler", "tokenizer", "detokenizer", "gateway")]
        base_env = {**env, "PYTHONPATH": os.pathsep.join(paths)}
    for i in range(args.runs):
        if base_env is not None:
            base.append(one_run(args.engine_args, base_env, args.timeout_s))
            print_run(f"base {i + 1}", base[-1])
        warm.append(one_run(args.engine_args, env, args.timeout_s))
        print_run(f"warm {i + 1}", warm[-1])
    if args.log and (warm or args.cold):
        with open(args.log, "w", encoding="utf-8") as f:
            f.write("\n".join((warm[-1] if warm else cold)["log"]) + "\n")
    if warm:
        med = {c: statistics.median(r[c] for r in warm) for c in COLUMNS if all(c in r for r in warm)}
        print_run("median", {**med, "ready": {}})
        print(
            f"median to serving {med['serving']:.2f}s = {med['serving'] / baseline:.1f}x the import-torch "
            f"baseline; to /health {med['health']:.2f}s; to the first token {med['first_token']:.2f}s"
        )
    if base and warm:
        for c in ("health", "serving", "first_token"):
            b, w = statistics.median(r[c] for r in base), statistics.median(r[c] for r in warm)
            print(f"median to {c}: {args.against} {b:.2f}s, this checkout {w:.2f}s (ratio {w / b:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
