"""Contract of meshlm.v1.SchedulerService when its peers or its loop fail, and as a process:
detokenizer fail-over and resync, no detokenizer, a crashed loop, and python -m meshlm.scheduler
(env flags, metrics, SIGTERM drain). The same tiny random Llama as test_scheduler_contract.py."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from meshlm.common.ports import free_port
from meshlm.v1 import common_pb2
from tests.serving import health_status

from .scheduler_harness import (
    PROMPT,
    SERVICE,
    RecordingDetokenizer,
    TokenizerStream,
    build_tiny_llama,
    greedy,
    kill_process,
    scheduler_process,
    tiny_service,
    wait_idle,
    wait_process_serving,
    wait_until,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_path: str) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm_path)


# ---- detokenizer fail-over --------------------------------------------------------------------
def test_detokenizer_failover_resyncs_and_completes(tiny_llama: str) -> None:
    d1, d2 = RecordingDetokenizer(), RecordingDetokenizer()
    service = tiny_service(tiny_llama, "sched-failover", (d1.address, d2.address))
    tok = TokenizerStream(service.address, "tok-failover")
    try:
        active, standby = wait_until(
            lambda: (d1, d2) if d1.snapshot() else (d2, d1) if d2.snapshot() else None, 10, "a Push stream"
        )
        assert active.hello().peer_id == "sched-failover"
        n = 250
        tok.generate("fo", PROMPT, sampling_params=greedy(n), stream=True)
        wait_until(lambda: len(active.entries("fo")) >= 2, 10, "fo to stream to the first detokenizer")
        active.kill()  # mid-generation
        finish = standby.wait_finish("fo", timeout=60)
        before = [i for e in active.entries("fo") for i in e["ids"]]
        assert standby.hello().peer_id == "sched-failover"
        entries = standby.entries("fo")
        resync = entries[0]
        assert resync["seeded"] and list(resync["seed"].prompt_tail_ids) == PROMPT[-5:]
        assert resync["offset"] == 0 and resync["ids"][: len(before)] == before
        offset = 0
        for e in entries:
            assert e["offset"] == offset
            offset += len(e["ids"])
        assert offset == n and finish.type == common_pb2.FINISH_TYPE_LENGTH
        assert not any(e["seeded"] for e in entries[1:])
        assert not tok.errors("fo")
        # The stream now goes to the standby: a new request arrives there with its seed.
        tok.generate("after-fo", PROMPT, sampling_params=greedy(3))
        standby.wait_finish("after-fo")
        assert standby.entries("after-fo")[0]["seeded"]
    finally:
        tok.cancel()
        service.stop()
        d1.kill()
        d2.kill()


def test_no_detokenizer_fails_requests_with_unavailable(tiny_llama: str) -> None:
    dead = RecordingDetokenizer()
    dead.kill()  # nothing listens there any more
    service = tiny_service(tiny_llama, "sched-nodetok", (dead.address,), detokenizer_timeout_s=1.0)
    tok = TokenizerStream(service.address, "tok-nodetok")
    try:
        t0 = time.monotonic()
        tok.generate("orphan", PROMPT, sampling_params=greedy(1500), stream=True)
        err = tok.wait_output(lambda o: o.WhichOneof("msg") == "error", timeout=20).error
        assert err.rid == "orphan" and err.reason.status_code == 503
        assert "no detokenizer" in err.reason.message
        assert 0.9 <= time.monotonic() - t0 < 20
        wait_idle(tok, timeout=3.0)  # the request was aborted: KV is back
    finally:
        tok.cancel()
        service.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_loop_crash_fails_requests_and_stops_the_service(tiny_llama: str) -> None:
    d = RecordingDetokenizer()
    service = tiny_service(tiny_llama, "sched-crash", (d.address,))
    tok = TokenizerStream(service.address, "tok-crash")
    try:
        runtime = service.server.runtime
        assert runtime is not None

        def boom(batch):
            raise RuntimeError("injected forward failure")

        runtime.scheduler.run_batch = boom  # the next forward crashes the loop thread
        tok.generate("doomed", PROMPT, sampling_params=greedy(4))
        err = tok.wait_output(lambda o: o.WhichOneof("msg") == "error", timeout=20).error
        assert err.rid == "doomed" and err.reason.status_code == 500 and "crashed" in err.reason.message
        assert tok.ended.wait(10)  # the service stopped: the stream ends
        assert service.server.exit_code == 1
    finally:
        tok.cancel()
        service.stop()
        d.kill()


# ---- the process: python -m meshlm.scheduler, env flags, metrics, SIGTERM drain -----------------
def test_process_serves_metrics_and_drains_on_sigterm(tiny_llama: str) -> None:
    d = RecordingDetokenizer()
    port, metrics_port = free_port(), free_port()
    env = {
        **os.environ,
        "MESHLM_SCHEDULER_MAX_TOTAL_TOKENS": "3000",  # engine flag from the environment
        "MESHLM_SCHEDULER_DETOKENIZER_ADDRS": d.address,
        "MESHLM_SCHEDULER_LOAD_REPORT_INTERVAL_S": "0.2",
    }
    proc = scheduler_process(
        port,
        "sched-proc",
        tiny_llama,
        "--metrics-port",
        str(metrics_port),
        "--grace-period-s",
        "60",
        env=env,
    )
    address = f"127.0.0.1:{port}"
    tok = None
    try:
        wait_process_serving(proc, address, "the scheduler process to serve")
        tok = TokenizerStream(address, "tok-proc")
        load = tok.wait_output(lambda o: o.WhichOneof("msg") == "load").load
        assert load.max_total_num_tokens == 3000 and load.scheduler_id == "sched-proc"
        tok.generate("warm", PROMPT, sampling_params=greedy(5))
        d.wait_finish("warm")

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
                return r.read().decode()

        def gauges_set() -> str | None:
            t = metrics()
            return t if "meshlm:max_total_num_tokens 3000.0" in t else None

        text = wait_until(gauges_set, 5, "the load gauges", interval=0.1)
        for name in (
            "num_running_reqs",
            "num_queue_reqs",
            "num_used_tokens",
            "token_usage",
            "cache_hit_rate",
            "num_retracted_reqs",
            "queue_time_seconds_bucket",
            "cached_tokens_total",
        ):
            assert f"meshlm:{name}" in text, name
        assert f"meshlm:prompt_tokens_total {float(len(PROMPT))}" in text
        assert "meshlm:generation_tokens_total 5.0" in text

        tok.generate("running", PROMPT, sampling_params=greedy(120), stream=True)
        wait_until(lambda: d.entries("running"), 10, "the long request to run")
        proc.send_signal(signal.SIGTERM)

        def not_serving() -> bool:
            return health_status(address, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING

        wait_until(not_serving, 5, "NOT_SERVING after SIGTERM")
        tok.generate("too-late", PROMPT, sampling_params=greedy(2))
        err = tok.wait_output(lambda o: o.WhichOneof("msg") == "error" and o.error.rid == "too-late").error
        assert err.reason.status_code == 503 and "shutting down" in err.reason.message
        finish = d.wait_finish("running", timeout=60)  # the running request finishes
        assert finish.type == common_pb2.FINISH_TYPE_LENGTH and finish.length == 120
        assert proc.wait(timeout=30) == 0
        assert tok.ended.wait(5)  # the Connect stream was ended by the scheduler
    finally:
        if tok is not None:
            tok.cancel()
        kill_process(proc)
        d.kill()
