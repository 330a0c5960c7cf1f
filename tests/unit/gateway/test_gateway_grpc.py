"""Tokenizer pool (round robin, retry on UNAVAILABLE, session pinning) and cancellation: a client that
goes away cancels the gRPC call, streaming or not, with the gateway running as `python -m meshlm.gateway`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from gateway_testlib import MODEL, UNREACHABLE, FakeTokenizerServer, make_config

from meshlm.gateway.app import create_app
from meshlm.gateway.grpc_client import TokenizerPool

REPO = Path(__file__).resolve().parents[3]


def wait_for(condition, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_unavailable_replica_is_retried(fake_tokenizer):
    fake_tokenizer.servicer.__init__()
    config = make_config(tokenizer_addrs=(UNREACHABLE, fake_tokenizer.address))
    with TestClient(create_app(config)) as client:
        for _ in range(4):  # whichever replica round robin picks first, every request succeeds
            response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert response.status_code == 200, response.text
            stream = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "stream": True})
            assert stream.status_code == 200 and "w0" in stream.text
        assert client.get("/health").status_code == 200  # one replica answers its health check
    assert len(fake_tokenizer.servicer.requests) == 8


def test_a_full_replica_sends_generate_to_another_and_all_full_is_503_at_once(fake_tokenizer):
    fake_tokenizer.servicer.__init__()
    fake_tokenizer.servicer.error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests in flight")
    with FakeTokenizerServer() as second:
        config = make_config(tokenizer_addrs=(fake_tokenizer.address, second.address))
        with TestClient(create_app(config)) as client:
            for _ in range(4):  # whichever replica is tried first, the one with room answers
                assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
            second.servicer.error = fake_tokenizer.servicer.error
            response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert "too many requests in flight" in response.json()["error"]["message"]
            assert client.get("/health").status_code == 200  # a full replica is not an unhealthy one
        assert len(second.servicer.requests) == 5


def test_round_robin_over_replicas(fake_tokenizer):
    fake_tokenizer.servicer.__init__()
    with FakeTokenizerServer() as second:
        config = make_config(tokenizer_addrs=(fake_tokenizer.address, second.address))
        with TestClient(create_app(config)) as client:
            for _ in range(6):
                assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
        assert len(fake_tokenizer.servicer.requests) == 3 and len(second.servicer.requests) == 3


def test_unhealthy_replica_is_skipped(fake_tokenizer):
    fake_tokenizer.servicer.__init__()
    with FakeTokenizerServer() as second:
        second.set_serving(False)

        async def run() -> list[str]:
            pool = TokenizerPool([fake_tokenizer.address, second.address])
            try:
                for ep in pool.endpoints():
                    await pool.check(ep)
                return [pool.pick().address for _ in range(4)]
            finally:
                await pool.close()

        assert set(asyncio.run(run())) == {fake_tokenizer.address}


def test_session_key_pins_a_replica():
    async def run() -> None:
        pool = TokenizerPool(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
        try:
            for key in ("s1", "s2", "another"):
                assert len({pool.pick(key=key).address for _ in range(5)}) == 1
            assert len({pool.pick().address for _ in range(3)}) == 3
        finally:
            await pool.close()

    asyncio.run(run())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gateway_process(fake_tokenizer):
    """`python -m meshlm.gateway` in a subprocess, in front of the fake tokenizer."""
    fake_tokenizer.servicer.__init__()
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(REPO / "services" / d) for d in ("common", "gateway")] + [os.environ.get("PYTHONPATH", "")]
        ),
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshlm.gateway",
            "--tokenizer-addrs",
            fake_tokenizer.address,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--grace-period-s",
            "3",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stdout.read()
            return False

    try:
        wait_for(healthy, 60.0, "the gateway to start")
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_standalone_gateway_and_disconnects(gateway_process, fake_tokenizer):
    proc, base = gateway_process
    fake = fake_tokenizer.servicer
    response = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=10,
    )
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == " w0 w1"

    # streaming: the client reads the first chunk, then hangs up
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST", f"{base}/v1/completions", json={"prompt": "HANG", "stream": True, "rid": "stream-rid"}
        ) as stream,
    ):
        first = next(stream.iter_lines())
        assert first.startswith("data: ") and "w0" in first
    wait_for(lambda: "stream-rid" in fake.cancelled, 10.0, "the streaming call to be cancelled")

    # not streaming: the client gives up (its read timeout) while the tokenizer still works
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/generate", json={"text": "HANG", "rid": "plain-rid"}, timeout=1.0)
    wait_for(lambda: "plain-rid" in fake.cancelled, 10.0, "the non-stream call to be cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/v1/chat/completions",
            timeout=1.0,
            json={"messages": [{"role": "user", "content": "HANG"}], "rid": "chat-rid"},
        )
    wait_for(lambda: "chat-rid" in fake.cancelled, 10.0, "the non-stream chat call to be cancelled")

    # SIGTERM with a request in flight: it gets the grace period (3 s), then is cancelled; exit 0
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{base}/v1/completions", json={"prompt": "HANG", "stream": True, "rid": "drain-rid"}
        ) as stream,
    ):
        lines = stream.iter_lines()
        assert "w0" in next(lines)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - start >= 2.5  # the in-flight request got its grace period
    wait_for(lambda: "drain-rid" in fake.cancelled, 10.0, "the in-flight call to be cancelled at shutdown")
