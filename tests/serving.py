"""A service process started as `meshlm launch` starts it (`python -m meshlm.<component>`), for
tests that look at the process itself (its threads, its libraries, its context switches)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.ports import free_port


def health_status(address: str, service: str = "") -> int | None:
    """What grpc.health.v1 at `address` answers for `service` ("": the whole server), a
    HealthCheckResponse status; None while it does not answer."""
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
            return reply.status
    except grpc.RpcError:
        return None


def serving(address: str, service: str = "") -> bool:
    """Whether grpc.health.v1 at `address` answers SERVING for `service` (False while it does
    not answer)."""
    return health_status(address, service) == health_pb2.HealthCheckResponse.SERVING


@contextmanager
def detokenizer_process(
    smollm_path: str, *flags: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A detokenizer on a free loopback port with `flags` (and `env` in place of this process's
    environment), once it serves: (its process, its address). Terminated on exit."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    argv = [sys.executable, "-m", "meshlm.detokenizer", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--tokenizer-path", smollm_path, "--log-level", "warning", *flags]
    proc = subprocess.Popen(argv, env=env if env is not None else dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not serving(address):
            assert proc.poll() is None and time.monotonic() < deadline, "the detokenizer did not serve"
            time.sleep(0.2)
        yield proc, address
    finally:
        proc.terminate()
        proc.wait(timeout=30)
