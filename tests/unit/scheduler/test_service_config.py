"""Scheduler service flags: defaults, MESHLM_SCHEDULER_* environment fallbacks (service and
engine flags), command line over environment, validation."""

from __future__ import annotations

import os

import pytest

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.service.config import SchedulerServiceConfig, build_parser, parse_args


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("MESHLM_SCHEDULER_"):
            monkeypatch.delenv(key)


def test_defaults() -> None:
    svc, eng = parse_args([])
    assert svc == SchedulerServiceConfig()
    assert eng == SchedulerConfig()
    assert svc.resolved_scheduler_id(1234).endswith("-1234")


def test_flags() -> None:
    svc, eng = parse_args(
        [
            "--port",
            "0",
            "--scheduler-id",
            "s1",
            "--detokenizer-addrs",
            "a:1, b:2",
            "--metrics-port",
            "9100",
            "--grace-period-s",
            "5",
            "--log-format",
            "json",
            "--max-total-tokens",
            "4096",
            "--disable-radix-cache",
        ]
    )
    assert svc.detokenizer_addrs == ("a:1", "b:2") and svc.scheduler_id == "s1" and svc.metrics_port == 9100
    assert svc.grace_period_s == 5.0 and svc.log_format == "json"
    assert eng.max_total_tokens == 4096 and eng.disable_radix_cache is True


def test_environment_fallback_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLM_SCHEDULER_DETOKENIZER_ADDRS", "detok:30020")
    monkeypatch.setenv("MESHLM_SCHEDULER_LOAD_REPORT_INTERVAL_S", "0.25")
    monkeypatch.setenv("MESHLM_SCHEDULER_MAX_TOTAL_TOKENS", "8192")
    monkeypatch.setenv("MESHLM_SCHEDULER_DISABLE_RADIX_CACHE", "true")
    monkeypatch.setenv("MESHLM_SCHEDULER_PORT", "31000")
    svc, eng = parse_args(["--port", "31001"])
    assert svc.detokenizer_addrs == ("detok:30020",) and svc.load_report_interval_s == 0.25
    assert eng.max_total_tokens == 8192 and eng.disable_radix_cache is True
    assert svc.port == 31001  # the command line wins


def test_invalid_values_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--detokenizer-addrs", "no-port"])
    with pytest.raises(SystemExit):
        parse_args(["--load-report-interval-s", "0"])
    monkeypatch.setenv("MESHLM_SCHEDULER_MAX_TOTAL_TOKENS", "lots")
    with pytest.raises(SystemExit):
        build_parser()


def test_main_requires_detokenizers() -> None:
    from meshlm.scheduler.__main__ import main

    with pytest.raises(SystemExit, match="detokenizer-addrs"):
        main([])
