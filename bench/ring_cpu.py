#!/usr/bin/env python
"""Where the ring's CPU goes: each service's CPU time per output token under streaming load.

    python bench/ring_cpu.py                                   # c=64, 64 x 256 in / 128 out
    python bench/ring_cpu.py --concurrency 16 --num-prompts 32
    python bench/ring_cpu.py --py-spy /tmp/prof                # also each service's stacks (py-spy, raw)
    python bench/ring_cpu.py --perf /tmp/perf                  # also the scheduler's native samples (perf)
    python bench/ring_cpu.py --engine --perf /tmp/perf --rounds 4   # ring vs the in-process engine, alternating
    python bench/ring_cpu.py --baseline-rev HEAD               # A/B: the services of a git revision
    python bench/ring_cpu.py --engine --scheduler-threads 1    # the relays on a core of their own

Starts `meshlm launch` (plus --meshlm-args), drives it with bench_online.py's streaming client
(tokens counted from usage) and reads each process's CPU seconds (utime + stime from /proc)
before and after the run: the scheduler, tokenizer, detokenizer and gateway, and this client.
Prints output tok/s and, per process, CPU seconds, the share of the run's wall time (1.0 = one
core busy), microseconds per output token, and its threads' context switches per 1000 output
tokens: waits (the thread blocked: a relay's wake-ups) and preemptions (it was taken off a core
while it could run). On a machine with as few cores as the scheduler has threads, every relay
microsecond is taken from the scheduler, and every relay wake-up preempts one of its OpenMP
threads, which stalls the other at the next barrier: these figures say what the ring / engine
ratio of bench_vs_vllm.py loses, and to whom.

With --engine the same workload then runs through the in-process Engine (a fresh process, the
same client code in it, the scheduler flags of --meshlm-args): it prints ring / engine output
tok/s and the scheduler's CPU per token and preemptions against the engine process's, and what the
shared-core model predicts (each relay or client microsecond costs the scheduler two: see
shared_core_model); with --perf too, both by shared object (the kernels, libgomp's OpenMP waits,
the kernel), so the scheduler's extra CPU in the ring is named.

With --scheduler-threads N the scheduler (and the engine process) runs N OpenMP threads
(OMP_NUM_THREADS, which the scheduler's CPU budget honours) instead of one per core. On a 2-core
machine N = 1 leaves the other core to the relays and the client: the layout of a cluster, where
each service runs in its own pod on its own CPUs, and there ring / engine says what the ring costs
the scheduler when it does not share its cores.

With --baseline-rev the services' Python code (services/) of that revision runs in a worktree
under the work folder against the same kernels cache, alternating with this tree's, `--rounds`
times each: the same sitting, as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshlm.common import event_loop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_clients import usage_stream  # noqa: E402
from bench_online import Result, make_workload, run_level  # noqa: E402
from bench_servers import HOST, Server, pid_cpu_s, pid_switches, start_server, stop, wait_idle  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("scheduler", "tokenizer", "detokenizer", "gateway")
RELAYS = SERVICES[1:]  # the services between the client and the scheduler


def service_pids(root: int) -> dict[str, list[int]]:
    """The service processes under the launcher `root`, by service (from their command lines)."""
    found: dict[str, list[int]] = {s: [] for s in SERVICES}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), -1)
        if ppid != root:
            continue
        for s in SERVICES:
            if f"meshlm.{s}".encode() in cmd:
                found[s].append(int(proc.name))
    return found


def perf_record(pid: int, out: Path) -> subprocess.Popen:
    """`perf record` of process `pid` into `out` until SIGINT (it writes its file then)."""
    cmd = ["perf", "record", "-F", "499", "-p", str(pid), "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def drive(srv: Server, work: list[dict[str, Any]], c: int) -> Result:
    return await run_level("ring", usage_stream(srv), work, c)


async def warm_up(srv: Server, work: list[dict[str, Any]]) -> None:
    """Two requests before the measured run (outside its CPU figures and samples)."""
    await run_level("warmup", usage_stream(srv), work[:2], 2)


def one_run(label: str, python_path: str | None, args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    from meshlm.launch.launcher import free_port

    hp, gp = free_port(HOST), free_port(HOST)
    argv = [sys.executable, "-m", "meshlm.launch.cli", "launch", "--host", HOST, "--port", str(hp)]
    argv += ["--grpc-port", str(gp), *args.meshlm_args.split()]
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = python_path
    srv = start_server(label, argv, env, hp, work_dir / f"server-{label}.log", 600)
    try:
        wait_idle(srv)  # the KV pool is faulted in on a background thread after /health
        work = make_workload("random", args.num_prompts, args.seed, args.input_len, args.output_len)
        pids = service_pids(srv.proc.pid)
        event_loop.run(warm_up(srv, work))
        spies = []
        if args.py_spy:
            args.py_spy.mkdir(parents=True, exist_ok=True)
            for s in SERVICES:
                for pid in pids[s]:
                    out = args.py_spy / f"{label}-{s}-{pid}.txt"  # collapsed stacks (flamegraph.pl's input)
                    spies.append(
                        subprocess.Popen(
                            [
                                "py-spy",
                                "record",
                                "-p",
                                str(pid),
                                "-o",
                                str(out),
                                "-f",
                                "raw",
                                "-r",
                                "100",
                                "--nonblocking",
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
        if args.perf:
            for pid in pids["scheduler"]:  # native samples: the kernels and libgomp's waits
                spies.append(perf_record(pid, args.perf / f"{label}-scheduler-{pid}.data"))
        if spies:
            time.sleep(0.5)  # the profilers attach
        before = {s: sum(pid_cpu_s(p) for p in ps) for s, ps in pids.items()}
        sw0 = {s: [pid_switches(p) for p in ps] for s, ps in pids.items()}
        me0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        res = event_loop.run(drive(srv, work, args.concurrency))
        wall = time.perf_counter() - t0
        me1 = resource.getrusage(resource.RUSAGE_SELF)
        after = {s: sum(pid_cpu_s(p) for p in ps) for s, ps in pids.items()}
        sw1 = {s: [pid_switches(p) for p in ps] for s, ps in pids.items()}
        for spy in spies:  # py-spy and perf write their output on SIGINT
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    finally:
        stop(srv.proc)
    tokens = sum(s.output_tokens for s in res.samples)
    cpu = {s: after[s] - before[s] for s in SERVICES}
    cpu["client"] = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
    switches = {
        s: (sum(b[0] - a[0] for a, b in zip(sw0[s], sw1[s])), sum(b[1] - a[1] for a, b in zip(sw0[s], sw1[s])))
        for s in SERVICES
    }
    switches["client"] = (me1.ru_nvcsw - me0.ru_nvcsw, me1.ru_nivcsw - me0.ru_nivcsw)
    native = perf_shares(args.perf, label, pids["scheduler"]) if args.perf else {}
    return {
        "label": label,
        "tok_s": tokens / res.wall,
        "tokens": tokens,
        "wall": wall,
        "cpu": cpu,
        "switches": switches,
        "native": native,
    }


def perf_shares(folder: Path, label: str, pids: list[int]) -> dict[str, float]:
    """Each shared object's share of the scheduler's perf samples (0..1, summed over its threads),
    from `perf report --sort dso` of the files this run recorded."""
    shares: dict[str, float] = {}
    for pid in pids:
        out = subprocess.run(
            ["perf", "report", "-i", str(folder / f"{label}-scheduler-{pid}.data"), "--sort", "dso", "--stdio"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        for line in out.splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0].endswith("%") and not line.startswith("#"):
                # our kernel builds are named <kernel>-<source hash>.so
                dso = fields[1].split("-")[0] if fields[1].endswith(".so") else fields[1]
                shares[dso] = shares.get(dso, 0.0) + float(fields[0].rstrip("%")) / 100 / len(pids)
    return shares


def engine_worker(args: argparse.Namespace) -> None:
    """The same workload through the in-process Engine and the same client code (this process):
    prints one JSON line with its figures (and records itself with perf when asked)."""
    from bench_clients import engine_config
    from bench_online import engine_stream
    from bench_servers import wait_cpu_idle

    from meshlm.scheduler.engine import Engine

    config = engine_config(shlex.split(args.meshlm_args))  # the ring's scheduler flags apply to the engine too
    work = make_workload("random", args.num_prompts, args.seed, args.input_len, args.output_len)
    with Engine(config) as engine:
        stream = engine_stream(engine)
        event_loop.run(run_level("warmup", stream, work[:2], 2))
        wait_cpu_idle(time.process_time)
        spy = None
        if args.perf:
            spy = perf_record(os.getpid(), args.perf / f"engine-scheduler-{os.getpid()}.data")
            time.sleep(0.5)  # perf attaches
        sw0, cpu0, t0 = pid_switches(os.getpid()), time.process_time(), time.perf_counter()
        res = event_loop.run(run_level("engine", stream, work, args.concurrency))
        cpu, wall, sw1 = time.process_time() - cpu0, time.perf_counter() - t0, pid_switches(os.getpid())
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    tokens = sum(x.output_tokens for x in res.samples)
    print(
        json.dumps(
            {
                "tokens": tokens,
                "wall": wall,
                "tok_s": tokens / res.wall,
                "cpu": cpu,
                "switches": [sw1[0] - sw0[0], sw1[1] - sw0[1]],
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )


def engine_run(args: argparse.Namespace) -> dict[str, Any]:
    """engine_worker in a fresh process (argv of this script plus --engine-worker)."""
    argv = [sys.executable, __file__, "--engine-worker", *sys.argv[1:]]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    fig = json.loads(out.strip().splitlines()[-1])
    native = perf_shares(args.perf, "engine", [fig["pid"]]) if args.perf else {}
    return {
        **fig,
        "label": "engine",
        "cpu": {"engine": fig["cpu"]},
        "switches": {"engine": fig["switches"]},
        "native": native,
    }


SPEED_PROBE = "gemm_bf16"  # a fixed amount of arithmetic per token: its CPU time tracks the machine's speed


def shared_core_model(ring: dict[str, Any], engine_us: float, measured: float) -> None:
    """What ring / engine should be when the relays and the client share the scheduler's cores.

    With as many OpenMP threads as cores, a relay (or client) microsecond on a core is taken from
    one OpenMP thread, and the other thread spends about as long waiting for it at the next
    barrier: the ring pays each such microsecond twice. With E the engine process's CPU per token
    and X the relays' and the client's, ring / engine ~ E / (E + 2 X); the target r needs
    X <= E (1 - r) / (2 r)."""
    relays = 1e6 * sum(ring["cpu"][s] for s in RELAYS) / ring["tokens"]
    x = relays + 1e6 * ring["cpu"]["client"] / ring["tokens"]
    need = engine_us * (1 - 0.95) / (2 * 0.95)
    print(
        f"shared-core model E / (E + 2 X), X = relays + client {x:.1f} us/token: {engine_us / (engine_us + 2 * x):.3f}"
        f" (measured {measured:.3f}); with the client on another machine (X = relays {relays:.1f}):"
        f" {engine_us / (engine_us + 2 * relays):.3f}; 0.95 needs X <= {need:.0f} us/token"
    )


def compare(ring: dict[str, Any], engine: dict[str, Any]) -> tuple[float, float | None]:
    """Ring / engine throughput, and where the scheduler's extra CPU per token goes. Returns the
    ratio, and (with perf samples) the ratio adjusted for the machine's speed: times the panel
    GEMM's CPU per token in the ring over the engine's (the same GEMMs run in both, so a VM that
    slowed down between the two runs shows there), None without perf samples."""
    ratio = ring["tok_s"] / engine["tok_s"]
    print(f"\nring / engine: {ratio:.3f} output tok/s")
    sched = 1e6 * ring["cpu"]["scheduler"] / ring["tokens"]
    eng = 1e6 * engine["cpu"]["engine"] / engine["tokens"]
    print(f"CPU us/token: scheduler in the ring {sched:.1f}, engine process (client included) {eng:.1f}")
    pre_r = 1e3 * ring["switches"]["scheduler"][1] / ring["tokens"]
    pre_e = 1e3 * engine["switches"]["engine"][1] / engine["tokens"]
    print(f"preemptions / 1k tokens: scheduler in the ring {pre_r:.0f}, engine process {pre_e:.0f}")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not (threads.isdigit() and int(threads) < len(os.sched_getaffinity(0))):  # else the relays have cores
        shared_core_model(ring, eng, ratio)
    if not (ring["native"] and engine["native"]):
        return ratio, None
    print(f"{'shared object':31s} {'ring':>8s} {'engine':>8s} {'delta':>8s}  (us/token)")
    for dso in sorted(ring["native"], key=lambda d: -ring["native"][d])[:10]:
        a = ring["native"][dso] * sched
        b = engine["native"].get(dso, 0.0) * eng
        print(f"  {dso[:29]:29s} {a:8.1f} {b:8.1f} {a - b:+8.1f}")
    probe_r, probe_e = ring["native"].get(SPEED_PROBE, 0.0) * sched, engine["native"].get(SPEED_PROBE, 0.0) * eng
    if not (probe_r and probe_e):
        return ratio, None
    adjusted = ratio * probe_r / probe_e
    print(f"ring / engine adjusted for the machine's speed ({SPEED_PROBE} us/token {probe_r:.0f} / {probe_e:.0f}):")
    print(f"  {adjusted:.3f}")
    return ratio, adjusted


def report(r: dict[str, Any]) -> None:
    print(f"\n[{r['label']}] {r['tok_s']:.1f} output tok/s ({r['tokens']} tokens in {r['wall']:.1f} s)")
    print(f"{'process':12s} {'cpu s':>8s} {'cores':>6s} {'us/token':>9s} {'waits/ktok':>11s} {'preempt/ktok':>13s}")
    for name, sec in r["cpu"].items():
        vol, invol = r["switches"][name]
        k = 1e3 / r["tokens"]
        per_token = 1e6 * sec / r["tokens"]
        print(f"{name:12s} {sec:8.2f} {sec / r['wall']:6.2f} {per_token:9.1f} {vol * k:11.0f} {invol * k:13.0f}")
    relays = sum(r["cpu"][s] for s in RELAYS)
    print(f"{'relays':12s} {relays:8.2f} {relays / r['wall']:6.2f} {1e6 * relays / r['tokens']:9.1f}")
    if r["native"]:  # libgomp: OpenMP threads waiting at barriers or for the next parallel region
        print(f"scheduler by shared object (perf): {'share':>6s} {'us/token':>9s}")
        for dso, share in sorted(r["native"].items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {dso[:30]:31s} {share:6.1%} {1e6 * share * r['cpu']['scheduler'] / r['tokens']:9.1f}")


def worktree(rev: str, work_dir: Path) -> Path:
    """A checkout of `rev` with its gRPC stubs generated (they are not committed)."""
    path = work_dir / f"rev-{rev.replace('/', '_')}"
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True)
        subprocess.run([sys.executable, str(path / "scripts" / "gen_protos.py")], check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256, help="prompt words (random workload)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--meshlm-args", default="", help="extra `meshlm launch` flags, one string")
    ap.add_argument(
        "--py-spy", type=Path, default=None, help="record each service's stacks (py-spy, collapsed) into this folder"
    )
    ap.add_argument(
        "--perf", type=Path, default=None, help="record the scheduler's native samples (perf record) into this folder"
    )
    ap.add_argument("--baseline-rev", default=None, help="also run the services of this git revision, alternating")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each side with --baseline-rev or --engine")
    ap.add_argument(
        "--engine",
        action="store_true",
        help="also run the in-process engine (same workload) and compare (not with --baseline-rev)",
    )
    ap.add_argument(
        "--scheduler-threads",
        type=int,
        default=None,
        help="OpenMP threads of the scheduler and the engine process (default: one per core)",
    )
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scheduler_threads is not None:  # inherited by the ring's scheduler and the engine worker
        if args.scheduler_threads < 1:
            ap.error("--scheduler-threads must be at least 1")
        os.environ["OMP_NUM_THREADS"] = str(args.scheduler_threads)
    if args.perf:
        args.perf.mkdir(parents=True, exist_ok=True)
    if args.engine_worker:
        engine_worker(args)
        return
    work_dir = Path(tempfile.mkdtemp(prefix="ring-cpu-"))
    if args.baseline_rev is None and not args.engine:
        report(one_run("now", None, args, work_dir))
        return
    if args.baseline_rev is None:
        ratios: list[tuple[float, float | None]] = []
        for rnd in range(args.rounds):  # the order alternates: the ring first in rounds 1, 3, ...
            pair: dict[str, dict[str, Any]] = {}
            for side in ("ring", "engine") if rnd % 2 == 0 else ("engine", "ring"):
                pair[side] = one_run("now", None, args, work_dir) if side == "ring" else engine_run(args)
            report(pair["ring"])
            ratios.append(compare(pair["ring"], pair["engine"]))
        if args.rounds > 1:
            adj = [b for _, b in ratios if b is not None]
            print(f"\nring / engine over {args.rounds} rounds: {', '.join(f'{a:.3f}' for a, _ in ratios)}")
            print(
                f"median {statistics.median(a for a, _ in ratios):.3f}"
                + (f", adjusted median {statistics.median(adj):.3f}" if adj else "")
            )
        return
    tree = worktree(args.baseline_rev, work_dir)
    base_path = os.pathsep.join(str(p) for p in sorted((tree / "services").iterdir()) if p.is_dir())
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "now": []}
    try:
        for _ in range(args.rounds):
            for label, path in (("base", base_path), ("now", None)):
                r = one_run(label, path, args, work_dir)
                report(r)
                runs[label].append(r)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"\nnow / base ({args.baseline_rev}), medians over {args.rounds} round(s):")
    # the run at the middle by throughput (of an even count, the upper of the two middle ones)
    med = {k: sorted(v, key=lambda r: r["tok_s"])[len(v) // 2] for k, v in runs.items()}
    print(f"{'output tok/s':16s} {med['now']['tok_s'] / med['base']['tok_s']:6.3f}")
    for name in (*SERVICES, "client"):
        a = med["base"]["cpu"][name] / med["base"]["tokens"]
        b = med["now"]["cpu"][name] / med["now"]["tokens"]
        print(f"{name + ' us/token':16s} {1e6 * a:8.1f} -> {1e6 * b:8.1f}  ({b / a if a else float('nan'):.3f}x)")


if __name__ == "__main__":
    main()
