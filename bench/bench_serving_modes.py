"""What each serving mode costs: the four services launched as plain unified (the baseline) and as
prefill/decode disaggregation, mutual TLS and tensor parallelism, on the same streaming workload,
printed as ratios against the baseline measured in the same run.

    python bench/bench_serving_modes.py                                   # unified,pd,mtls,tp3
    python bench/bench_serving_modes.py --modes unified,pd --concurrency 1,16 --input-len 512

Modes: `unified` (one scheduler), `pd` (one prefill + one decode scheduler: every request's KV
crosses gRPC), `mtls` (every gRPC link on mutual TLS, throwaway CA), `tp3` (one scheduler with
three tensor-parallel ranks). On a CPU-only machine with few cores, pd and tp3 add processes that
compete for the same cores: the ratios show their overhead there, not their benefit on GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_online import Result, bench_openai, make_workload, print_table  # noqa: E402

MODES = ("unified", "pd", "mtls", "tp3")


def plan_for(mode: str, model: str, engine_args: tuple[str, ...], tmp: Path) -> Any:
    from meshlm.launch.launcher import LaunchPlan, free_port

    kw: dict[str, Any] = {}
    args = engine_args
    if mode == "pd":
        kw["decode_dp_size"] = 1
    elif mode == "tp3":  # the default SmolLM2 has 9 attention heads: tp must divide 9
        args = args + ("--tp-size", "3")
    elif mode == "mtls":
        from tests.tls_certs import make_pki

        kw["tls"] = make_pki(tmp / "pki").tls()
    return LaunchPlan(
        model_path=model,
        tokenizer_path=model,
        http_port=free_port(),
        grpc_port=free_port(),
        scheduler_args=args,
        log_level="warning",
        **kw,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256, help="words per prompt (random) / system prompt")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes must name some of {MODES}")
    if modes[0] != "unified":
        modes = ["unified"] + [m for m in modes if m != "unified"]
    levels = [int(x) for x in args.concurrency.split(",")]
    work = make_workload(args.workload, args.num_prompts, args.seed, args.input_len, args.output_len)

    from meshlm.launch.launcher import launch
    from meshlm.scheduler.model_loader import resolve_model_path

    model = str(resolve_model_path(None))
    engine_args = ("--max-total-tokens", "40000", "--max-running-requests", "128")
    results: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            system = launch(plan_for(mode, model, engine_args, Path(tmp)))
            try:
                rows = asyncio.run(bench_openai(system.http_url + "/v1", work, levels))
            finally:
                system.stop()
            for r in rows:
                r.label = mode
            results[mode] = rows
            print_table(rows)  # as each mode finishes: a long run that dies keeps what it measured
    print_table([r for rows in results.values() for r in rows])
    base = results["unified"]
    print("\nratios mode / unified (out tok/s: higher is better; TTFT, ITL: lower is better)")
    for mode in modes[1:]:
        for r, b in zip(results[mode], base):
            rv, bv = r.row(), b.row()

            def ratio(k: str, rv: dict[str, float] = rv, bv: dict[str, float] = bv) -> float:
                return rv[k] / max(bv[k], 1e-9)

            print(
                f"  {mode:<8} conc {r.concurrency:>3}: out tok/s {ratio('out tok/s'):.3f}  "
                f"TTFT p50 {ratio('ttft p50 ms'):.3f}  p99 {ratio('ttft p99 ms'):.3f}  "
                f"ITL p50 {ratio('itl p50 ms'):.3f}  p99 {ratio('itl p99 ms'):.3f}"
            )


if __name__ == "__main__":
    main()
