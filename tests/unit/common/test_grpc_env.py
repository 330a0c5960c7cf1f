"""The ring's processes load gRPC with its classic socket endpoints (GRPC_EXPERIMENTS), unless
the environment chose otherwise; a serving service then wakes fewer threads per call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.serving import detokenizer_process

from meshlm.common.grpc_env import CLASSIC_ENDPOINTS

PROBE = """
import os, sys
from meshlm.common.grpc_env import prefer_classic_endpoints
if sys.argv[1] == "late":
    import grpc
print(prefer_classic_endpoints(), repr(os.environ.get("GRPC_EXPERIMENTS")))
"""


def _env(grpc_experiments: str | None) -> dict[str, str]:
    """This process's environment with GRPC_EXPERIMENTS as given (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if grpc_experiments is not None:
        env["GRPC_EXPERIMENTS"] = grpc_experiments
    return env


def _probe(when: str, env_value: str | None) -> str:
    cmd = [sys.executable, "-c", PROBE, when]
    return subprocess.run(
        cmd, env=_env(env_value), capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


def test_the_default_is_set_before_grpc_loads() -> None:
    assert _probe("early", None) == f"True {CLASSIC_ENDPOINTS!r}"


def test_a_choice_in_the_environment_is_kept() -> None:
    assert _probe("early", "") == "False ''"  # empty: gRPC's own defaults
    assert _probe("early", "-event_engine_dns") == "False '-event_engine_dns'"


def test_too_late_once_grpc_is_loaded() -> None:
    assert _probe("late", None) == "False None"


def _wakeups(pid: int) -> int:
    """Voluntary context switches so far of every thread of `pid`: each is a thread going to
    sleep, so one per wake-up (preemptions, which depend on the machine's other load, are not
    counted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def _wakeups_per_call(smollm_path: str, env_value: str | None) -> float:
    """A detokenizer started as the launcher starts it (`python -m`), GRPC_EXPERIMENTS as given
    (None: unset): its threads' wake-ups per health check, over 400 checks."""
    with detokenizer_process(smollm_path, env=_env(env_value)) as (proc, address), grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(50):  # connection and first-call work, outside the count
            stub.Check(health_pb2.HealthCheckRequest())
        before = _wakeups(proc.pid)
        for _ in range(400):
            stub.Check(health_pb2.HealthCheckRequest())
        return (_wakeups(proc.pid) - before) / 400


def test_a_serving_service_wakes_fewer_threads_per_call(smollm_path: str) -> None:
    """~6-7 wake-ups a unary call with the classic endpoints against ~9-10 with gRPC's
    EventEngine ones (GRPC_EXPERIMENTS='' keeps gRPC's defaults) on a 2-core machine. Counted
    as all context switches, preemptions included, the ratio moved with the machine's load
    (0.55-0.72, once above 0.85)."""
    classic = _wakeups_per_call(smollm_path, None)
    event_engine = _wakeups_per_call(smollm_path, "")
    assert classic < 0.85 * event_engine, (classic, event_engine)
