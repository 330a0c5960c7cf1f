"""End-to-end fixtures: all four services as real processes on loopback (what `meshlm launch`
starts), the default SmolLM2-135M-Instruct model, an in-test OTLP receiver."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from meshlm.launch.launcher import LaunchPlan, System, free_port, launch

from .otlp_receiver import OtlpReceiver

ENGINE_ARGS = ("--dtype", "float32", "--max-total-tokens", "12000", "--max-running-requests", "96")


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver()
    yield rx
    rx.stop()


def start_system(model: str, otlp_endpoint: str | None = None, ready_timeout_s: float = 180, **kw: Any) -> System:
    plan = LaunchPlan(
        model_path=model,
        tokenizer_path=model,
        http_port=free_port(),
        grpc_port=free_port(),
        scheduler_args=ENGINE_ARGS + tuple(kw.pop("scheduler_args", ())),
        otlp_endpoint=otlp_endpoint,
        log_level="warning",
        **kw,
    )
    return launch(plan, ready_timeout_s=ready_timeout_s)


@pytest.fixture(scope="module")
def system(smollm_path: str, otlp: OtlpReceiver) -> Iterator[System]:
    """One replica of each service, exporting spans to the in-test receiver."""
    sys_ = start_system(smollm_path, otlp.endpoint)
    yield sys_
    sys_.stop()


def http_json(url: str, body: Any = None, method: str | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if body is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback)
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_idle(system: System, timeout: float = 5.0) -> dict:
    """Poll /get_server_info until every scheduler has nothing running and no used tokens."""
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        _, info = http_json(system.http_url + "/get_server_info")
        scheds = info.get("schedulers") or info.get("scheduler_info") or []
        if scheds and all(s["num_running_reqs"] == 0 and s["num_used_tokens"] == 0 for s in scheds):
            return info
        time.sleep(0.1)
    raise AssertionError(f"schedulers not idle within {timeout}s: {info}")
