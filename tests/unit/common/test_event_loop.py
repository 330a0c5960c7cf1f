"""The processes' asyncio loop is uvloop (a dependency), the standard loop where uvloop cannot
be imported; a serving relay has uvloop loaded (the gateway's uvicorn: test_gateway_app.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common import event_loop
from meshlm.common.ports import free_port


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_is_on_uvloop() -> None:
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_without_uvloop_run_is_on_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` raise ImportError
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(_loop_module()).startswith("asyncio")


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_a_serving_detokenizer_runs_uvloop(smollm_path: str) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "meshlm.detokenizer", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*argv, "--tokenizer-path", smollm_path, "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 60
        while not _serving(f"127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, "the detokenizer did not serve"
            time.sleep(0.2)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "uvloop/loop." in maps  # uvloop's extension module is mapped
    finally:
        proc.terminate()
        proc.wait(timeout=30)
