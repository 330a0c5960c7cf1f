"""`meshlm launch` passes both overload limits on: the engine flag --max-queued-requests (SGLang's: each
scheduler's waiting queue) to every scheduler, --tokenizer-max-queued-requests (requests in flight
per tokenizer replica) to every tokenizer as its own --max-queued-requests."""

from __future__ import annotations

from pathlib import Path

from meshlm.launch.cli import build_parser, launch_plan
from meshlm.launch.launcher import plan_children


def _args_of(children, component: str) -> list[list[str]]:
    return [c.argv for c in children if c.component == component]


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_launch_passes_both_queue_limits(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = ["launch", "--model", str(tmp_path), "--dp-size", "2", "--tokenizer-replicas", "2"]
    plan = launch_plan(
        build_parser().parse_args([*argv, "--max-queued-requests", "3", "--tokenizer-max-queued-requests", "7"])
    )
    children = plan_children(plan)
    assert [_value(a, "--max-queued-requests") for a in _args_of(children, "scheduler")] == ["3", "3"]
    assert [_value(a, "--max-queued-requests") for a in _args_of(children, "tokenizer")] == ["7", "7"]
    assert all("--max-queued-requests" not in a for a in _args_of(children, "gateway"))

    defaults = plan_children(launch_plan(build_parser().parse_args(argv)))
    assert all("--max-queued-requests" not in a for c in ("scheduler", "tokenizer") for a in _args_of(defaults, c))
