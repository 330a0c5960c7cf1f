"""exit_with_launcher: a process whose parent dies gets SIGTERM; without the variable, nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from meshlm.common.launcher_watch import LAUNCHER_PID_ENV

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from meshlm.common.launcher_watch import LAUNCHER_PID_ENV, exit_with_launcher
    armed = exit_with_launcher()
    print(armed, LAUNCHER_PID_ENV in os.environ, flush=True)
    time.sleep(float(sys.argv[1]))
    """
)


def _run(env_pid: str | None, sleep_s: float = 0.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    if env_pid is not None:
        env[LAUNCHER_PID_ENV] = env_pid
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(sleep_s)], env=env, capture_output=True, text=True, timeout=60
    )


def test_without_the_variable_nothing_happens() -> None:
    res = _run(None)
    assert res.returncode == 0 and res.stdout.split() == ["False", "False"]


def test_parent_already_gone_means_sigterm_at_once() -> None:
    # The variable names a pid that is not the parent: as if the launcher died before the prctl.
    res = _run("1", sleep_s=30)
    assert res.returncode == -signal.SIGTERM, res.stderr


def test_sigkilled_parent_sends_sigterm_and_the_variable_is_not_inherited() -> None:
    # parent: a shell-like python that starts the child with its own pid, prints the child's pid,
    # then waits; SIGKILL it and the child (sleeping 60 s) must end by SIGTERM.
    parent_code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = dict(os.environ, {LAUNCHER_PID_ENV}=str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}, "60"], env=env)
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    # The child's own line (its stdout is the parent's): armed, and the variable gone from its
    # environment, so processes it starts (TP ranks) are not tied to the launcher.
    assert parent.stdout.readline().split() == ["True", "False"]
    parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited, not yet reaped by its new parent
        except OSError:
            return  # exited and reaped
        time.sleep(0.1)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the child outlived its killed parent by 30 s")
