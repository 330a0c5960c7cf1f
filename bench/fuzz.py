"""The long edge fuzz (issue 12): the fuzzers of tests/e2e/fuzzing.py with >= 10k cases each.

    python bench/fuzz.py                          # start the services (SmolLM2), 10k+ REST and gRPC cases
    python bench/fuzz.py --rest-examples 30 --grpc-examples 150 --seed 7       # the suite's size
    python bench/fuzz.py --http-url http://127.0.0.1:30000 --grpc-address 127.0.0.1:30001   # a running system

REST: schemathesis over /openapi.json, `--rest-examples` positive and as many negative cases per
operation with inputs (12 of the 18: 450 -> 10.8k cases; the 6 without inputs have one case
each); gRPC: `--grpc-examples` cases per public RPC (10 RPCs: 1200 -> 12k). Prints the statuses
seen per operation, every failure (a 5xx; INTERNAL / UNKNOWN / UNAVAILABLE / DEADLINE_EXCEEDED)
and whether the system still answers the greedy probe as before; exits 1 on any failure. No
seed = a new random run each time. The run is long (tens of minutes): schemathesis builds
each case in tens of milliseconds, and the valid generations take the model's time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _service in ("common", "scheduler", "tokenizer", "detokenizer", "gateway"):
    sys.path.insert(0, str(ROOT / "services" / _service))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.e2e.conftest import wait_idle  # noqa: E402
from tests.e2e.fuzzing import Tally, fuzz_grpc, fuzz_rest, fuzz_system, greedy_probe, wait_answering  # noqa: E402

from meshlm.launch.launcher import System  # noqa: E402


class _Running:
    """A system started elsewhere, addressed by URL and gRPC address (what the fuzzers use)."""

    def __init__(self, http_url: str, grpc_address: str) -> None:
        self.http_url = http_url.rstrip("/")
        self.grpc_address = grpc_address


def _report(name: str, tally: Tally, seconds: float) -> None:
    print(f"\n== {name}: {tally.cases} cases in {seconds:.0f}s, {len(tally.failures)} failures")
    for key, count in sorted(tally.statuses.items()):
        print(f"  {key:<45} {count}")
    print("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in tally.seconds.most_common()))
    for failure in tally.failures:
        print(f"  FAILURE {failure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rest-examples", type=int, default=450, help="cases per operation and mode (default 450)")
    parser.add_argument("--grpc-examples", type=int, default=1200, help="cases per RPC (default 1200)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--http-url", default=None, help="fuzz this running gateway instead of starting one")
    parser.add_argument("--grpc-address", default=None, help="its tokenizer's public gRPC address")
    parser.add_argument("--skip-rest", action="store_true")
    parser.add_argument("--skip-grpc", action="store_true")
    args = parser.parse_args(argv)

    started: System | None = None
    system: Any
    if args.http_url:
        if not args.grpc_address:
            parser.error("--http-url needs --grpc-address")
        system = _Running(args.http_url, args.grpc_address)
    else:
        from meshlm.scheduler.model_loader import resolve_model_path

        model = args.model or str(resolve_model_path(None))
        started = system = fuzz_system(model)
        print(f"started the services: HTTP {system.http_url}, gRPC {system.grpc_address}")
    failed = False
    try:
        golden = greedy_probe(system)
        print(f"greedy probe: {golden['text']!r}")
        for name, skip, run, examples in (
            ("REST (schemathesis)", args.skip_rest, fuzz_rest, args.rest_examples),
            ("gRPC (hypothesis)", args.skip_grpc, fuzz_grpc, args.grpc_examples),
        ):
            if skip:
                continue
            start = time.monotonic()
            try:
                tally = run(system, examples, seed=args.seed)
            except Exception as e:  # the first failure ends a fuzzer (no shrinking); report what ran
                print(f"{name}: stopped at a failure: {type(e).__name__}: {str(e)[:500]}")
                failed = True
                continue
            _report(name, tally, time.monotonic() - start)
            failed |= bool(tally.failures)
        wait_answering(system)
        after = greedy_probe(system)
        same = after == golden
        print(f"\ngreedy probe after: {'same' if same else 'DIFFERENT: ' + repr(after['text'])}")
        failed |= not same
        wait_idle(system, timeout=60)
        print("schedulers idle, no KV in use")
    finally:
        if started is not None:
            started.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
