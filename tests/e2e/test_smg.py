"""SGLang's model gateway (smg, PyPI `smg`) in front of two meshlm systems.

smg decides what a worker is by probing it: `/v1/models`' owned_by, then `/version` (vLLM) and
`/server_info` (SGLang); it reads `/server_info` and `/model_info` into the worker's labels and polls
`/v1/loads?include=core,disagg,queues,memory` for its load-aware policies. These tests run smg for
real (its Rust router, `smg launch`) against two full meshlm systems (SmolLM2, tiny KV pools) and check
* both register as runtime `sglang` with the labels meshlm reports (smg's GET /workers);
* under load, each system's /v1/loads shows its running requests, and smg reads them (its /get_loads);
* with `--policy power_of_two` (token usage from the polled loads) requests go to the idle system;
* chat, completions and /generate stream through smg with the same greedy text as meshlm directly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from meshlm.common.cpus import available_cpus
from meshlm.launch.launcher import LaunchPlan, System, free_port, launch

from .conftest import ENGINE_ARGS, wait_idle

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("smg") is None, reason="needs smg (PyPI `smg`)"),
]

ENGINE = ("--max-total-tokens", "2500", "--max-running-requests", "8")
LONG = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}


def get_json(url: str, timeout: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback)
        return json.loads(r.read())


def wait_for(what: str, pred: Any, timeout: float = 180, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (OSError, ValueError) as e:  # not up yet
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def systems(smollm_path: str) -> Iterator[list[System]]:
    """Two meshlm systems, started at once (each launch mostly waits on its own processes)."""
    started: list[System | BaseException] = []

    def one() -> None:
        try:
            plan = LaunchPlan(
                model_path=smollm_path,
                tokenizer_path=smollm_path,
                http_port=free_port(),
                grpc_port=free_port(),
                scheduler_args=ENGINE_ARGS + ENGINE,
                log_level="warning",
            )
            # two at once on a small machine: be patient, and split the CPUs as a user running two
            # systems on one host would (each scheduler's OpenMP threads on all of them spin
            # against the other's)
            share = {"OMP_NUM_THREADS": str(max(1, available_cpus() // 2))}
            started.append(launch(plan, ready_timeout_s=600, env=share))
        except BaseException as e:  # reported below
            started.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [s for s in started if isinstance(s, System)]
    try:
        for s in started:
            if not isinstance(s, System):
                raise s
        yield sorted(ok, key=lambda s: s.plan.http_port)
    finally:  # stopped at once too: each stop waits out its services' drain
        stops = [threading.Thread(target=s.stop) for s in ok]
        for t in stops:
            t.start()
        for t in stops:
            t.join()


@pytest.fixture(scope="module")
def smg(systems: list[System], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`smg launch` routing over both systems with power-of-two choices on polled load."""
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    argv = ["smg", "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *[s.http_url for s in systems], "--policy", "power_of_two"]
    argv += ["--load-monitor-interval", "1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"smg exited with {proc.returncode}: {log.read_text()[-3000:]}"
            workers = get_json(url + "/workers")["workers"]
            return len(workers) == 2 and all(w["status"] == "ready" and w["is_healthy"] for w in workers)

        wait_for("smg to register both workers", ready)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_both_systems_register_as_sglang_runtimes(systems: list[System], smg: str) -> None:
    workers = {w["url"]: w for w in get_json(smg + "/workers")["workers"]}
    assert sorted(workers) == sorted(s.http_url for s in systems)
    for s in systems:
        w = workers[s.http_url]
        assert w["runtime_type"] == "sglang" and w["connection_mode"] == "http", w
        model = get_json(s.http_url + "/model_info")
        labels = w["labels"]
        assert labels["served_model_name"] == model["served_model_name"]
        assert labels["model_path"] == model["model_path"] and labels["is_generation"] == "true"
        assert labels["dp_size"] == "1" and labels["max_total_tokens"] == "2500", labels


def long_stream(system: System, prompt: str, done: list[str]) -> threading.Thread:
    def run() -> None:
        body = {"text": prompt, "stream": True, "sampling_params": LONG}
        with httpx.stream("POST", system.http_url + "/generate", json=body, timeout=600) as r:
            assert r.status_code == 200
            done.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def requests_by_route(system: System) -> dict[str, float]:
    """meshlm:http_requests_total of a system's gateway, summed per route."""
    with urllib.request.urlopen(system.http_url + "/metrics", timeout=30) as r:  # noqa: S310
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("meshlm:http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="', 1)[1].split('"', 1)[0]
            out[route] = out.get(route, 0.0) + float(value)
    return out


def smg_load_of(smg: str, url: str) -> dict | None:
    for entry in get_json(smg + "/get_loads").get("loads", []):
        if entry.get("worker") == url:
            return entry
    return None


def test_loads_show_running_requests_and_smg_routes_to_the_idle_system(systems: list[System], smg: str) -> None:
    busy, idle = systems
    lines: list[str] = []
    streams = [long_stream(busy, f"Count from {i} to one hundred:", lines) for i in range(3)]
    loads = wait_for(
        "the busy system's /v1/loads to show 3 running requests",
        lambda: [x for x in get_json(busy.http_url + "/v1/loads")["loads"] if x["num_running_reqs"] == 3],
    )
    assert loads[0]["num_used_tokens"] > 0 and loads[0]["token_usage"] > 0
    seen = wait_for(
        "smg's /get_loads to show the busy system's running requests",
        lambda: (e := smg_load_of(smg, busy.http_url)) is not None and e["num_running_reqs"] > 0 and e,
    )
    assert seen["token_usage"] > 0 and seen["max_total_num_tokens"] == 2500
    before = {s.http_url: requests_by_route(s) for s in systems}

    # Three streams through smg, started together: power-of-two on token usage picks the idle one.
    client = openai.OpenAI(base_url=smg + "/v1", api_key="-", max_retries=0, timeout=600)
    results: dict[str, str] = {}

    def chat() -> None:
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Name three colors."}],
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        results["chat"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion() -> None:
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=48, temperature=0, stream=True
        )
        results["completions"] = "".join(c.choices[0].text for c in stream if c.choices)

    def generate() -> None:
        body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
        with httpx.stream("POST", smg + "/generate", json=body, timeout=600) as r:
            assert r.status_code == 200, r.read()
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        results["generate"] = json.loads(events[-2])["text"]

    routed = [threading.Thread(target=f, daemon=True) for f in (chat, completion, generate)]
    for t in routed:
        t.start()
    wait_for(
        "the idle system's /v1/loads to show the requests smg sent it",
        lambda: any(x["num_running_reqs"] > 0 for x in get_json(idle.http_url + "/v1/loads")["loads"]),
        interval=0.05,
    )
    for t in routed:
        t.join(timeout=600)
    assert set(results) == {"chat", "completions", "generate"} and all(results.values()), results
    after = {s.http_url: requests_by_route(s) for s in systems}
    for route in ("/v1/chat/completions", "/v1/completions", "/generate"):
        got = after[idle.http_url].get(route, 0) - before[idle.http_url].get(route, 0)
        assert got == 1, (route, before, after)
    assert after[busy.http_url].get("/v1/chat/completions", 0) == before[busy.http_url].get("/v1/chat/completions", 0)

    # The same requests straight to meshlm give the same greedy text: smg passed them through intact.
    direct = openai.OpenAI(base_url=idle.http_url + "/v1", api_key="-", max_retries=0, timeout=600)
    chat_direct = direct.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=48,
        temperature=0,
    )
    assert chat_direct.choices[0].message.content == results["chat"]
    comp_direct = direct.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=48, temperature=0
    )
    assert comp_direct.choices[0].text == results["completions"]
    for t in streams:
        t.join(timeout=600)
    assert lines.count("data: [DONE]") == len(streams)
    for s in systems:
        wait_idle(s, timeout=30)
