"""`meshlm launch` stopped by SIGTERM while its services are still starting (a supervisor giving up,
`kill` from a shell): it stops every service it started and exits 143, leaving no process
behind to hold the ports. (SIGTERM once serving is covered by every test that launches the CLI.)
And `meshlm launch` killed outright (SIGKILL, the OOM killer): its services end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshlm.launch.launcher import free_port

from .conftest import ENGINE_ARGS


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _launch(smollm_path: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "meshlm.launch.cli",
        "launch",
        "--model-path",
        smollm_path,
        "--port",
        str(free_port()),
        "--grpc-port",
        str(free_port()),
        *ENGINE_ARGS,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLM_") or k == "MESHLM_CACHE"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _four_children(proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 60
    children: list[int] = []
    while len(children) < 4 and time.monotonic() < deadline and proc.poll() is None:
        children = _children_of(proc.pid)
        time.sleep(0.05)
    assert len(children) == 4, "meshlm launch did not start its four services"
    return children


def test_sigkill_of_the_launcher_ends_every_service(smollm_path: str) -> None:
    proc = _launch(smollm_path)
    children: list[int] = []
    try:
        children = _four_children(proc)
        time.sleep(1.0)  # past each service's exit_with_launcher() (its first statement)
        proc.kill()
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 60
        left = children
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [pid for pid in children if _alive(pid)]
        assert not left, f"services still running 60 s after the launcher was killed: {left}"
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_during_start_up_stops_every_service(smollm_path: str) -> None:
    proc = _launch(smollm_path)
    try:
        children = _four_children(proc)
        proc.send_signal(signal.SIGTERM)  # the scheduler is still loading: start-up is not over
        out, _ = proc.communicate(timeout=60)
        assert "meshlm is serving" not in out, "start-up finished before the signal; the test proves nothing"
        assert proc.returncode == 143, out[-2000:]
        assert "stopped during start-up" in out
        left = [pid for pid in children if _alive(pid)]
        assert not left, f"services left running after the launcher exited: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _children_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
