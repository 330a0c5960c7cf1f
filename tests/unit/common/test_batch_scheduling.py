"""batch_scheduling puts every thread of a process under SCHED_BATCH, those it already runs and
those it starts later; a service started with --batch-scheduling serves with all its threads
under it; `meshlm launch --batch-relays` asks it of the relays (the gateway, tokenizers and
detokenizers) and never of a scheduler, and by default of none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.serving import detokenizer_process

from meshlm.launch.cli import build_parser, launch_plan
from meshlm.launch.launcher import plan_children

SCRIPT = """
import os, threading
from meshlm.common.cpus import batch_scheduling
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
ok = batch_scheduling()
after = threading.Thread(target=stop.wait)
after.start()
policies = {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
stop.set()
print(ok, len(os.listdir("/proc/self/task")), sorted(policies))
"""


def test_every_thread_before_and_after_the_call_is_batch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    ok, threads, policies = out.stdout.split(maxsplit=2)
    assert ok == "True"
    assert int(threads) >= 3  # main, the thread started before, the one started after
    assert policies.strip() == str([os.SCHED_BATCH])


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_serving_detokenizer_has_every_thread_under_it(smollm_path: str) -> None:
    """gRPC's threads, started after the flag took effect, included; without the flag, none."""
    for flag, expect in (("--batch-scheduling", os.SCHED_BATCH), ("--no-batch-scheduling", os.SCHED_OTHER)):
        with detokenizer_process(smollm_path, flag) as (proc, _):
            assert len(os.listdir(f"/proc/{proc.pid}/task")) > 1
            assert _policies(proc.pid) == {expect}


def test_launch_asks_it_of_the_relays_only_when_told(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = ["launch", "--model", str(tmp_path), "--dp-size", "2", "--tokenizer-replicas", "2"]
    children = plan_children(launch_plan(build_parser().parse_args([*argv, "--batch-relays"])))
    batch = {c.name for c in children if "--batch-scheduling" in c.argv}
    assert batch == {"gateway", "tokenizer-0", "tokenizer-1", "detokenizer-0"}
    assert {c.name for c in children} - batch == {"scheduler-0", "scheduler-1"}

    default = plan_children(launch_plan(build_parser().parse_args(argv)))
    assert not any("--batch-scheduling" in c.argv for c in default)
