"""SchedulerRuntime builds the Scheduler in the thread that later runs its loop (one libgomp
worker team for the process: see runtime.py), hands a build error to its constructor, and
stops a loop that was never started."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meshlm.scheduler import runtime as runtime_mod
from meshlm.scheduler.config import SchedulerConfig


class _FakeScheduler:
    """Records which thread built it and which ran its loop; the loop waits for stop()."""

    fail_build = False

    def __init__(self, *args: Any) -> None:
        if self.fail_build:
            raise RuntimeError("weights are missing")
        self.built_in = threading.get_ident()
        self.loop_in: int | None = None
        self.iterations = 0
        self._stop = threading.Event()

    def event_loop_normal(self) -> None:
        self.loop_in = threading.get_ident()
        self.iterations += 1
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[_FakeScheduler]:
    monkeypatch.setattr(runtime_mod, "load_model_facts", lambda config: (config, object(), object()))
    monkeypatch.setattr(runtime_mod, "Scheduler", _FakeScheduler)
    monkeypatch.setattr(_FakeScheduler, "fail_build", False)
    return _FakeScheduler


def test_the_loop_runs_in_the_thread_that_built_the_scheduler(fake: type[_FakeScheduler]) -> None:
    rt = runtime_mod.SchedulerRuntime(SchedulerConfig(), lambda m: None, lambda m: None)
    sched = rt.scheduler
    assert isinstance(sched, fake) and sched.built_in != threading.get_ident()
    assert not rt.is_alive() and sched.loop_in is None  # built, not yet running
    rt.start()
    for _ in range(200):
        if sched.loop_in is not None:
            break
        threading.Event().wait(0.01)
    assert sched.loop_in == sched.built_in and rt.is_alive()
    rt.stop(timeout=5)
    assert not rt.is_alive()


def test_a_build_error_is_raised_by_the_constructor(fake: type[_FakeScheduler]) -> None:
    fake.fail_build = True
    with pytest.raises(RuntimeError, match="weights are missing"):
        runtime_mod.SchedulerRuntime(SchedulerConfig(), lambda m: None, lambda m: None)


def test_stop_without_start_ends_the_thread(fake: type[_FakeScheduler]) -> None:
    rt = runtime_mod.SchedulerRuntime(SchedulerConfig(), lambda m: None, lambda m: None)
    rt.stop(timeout=5)
    assert not rt._thread.is_alive() and rt.scheduler.iterations == 1  # type: ignore[attr-defined]
