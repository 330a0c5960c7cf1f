"""One system for the front-end fault tests of this package (started once, torn down after it):
two tokenizer replicas, one scheduler, one detokenizer and the launched gateway, plus a second
gateway replica (`second`, with a short --stream-stall-timeout-s) on the same tokenizers. Tests
that kill a component restart it with the same argv, so the system is whole again after each."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshlm.launch.launcher import Child, System, free_port

from ..conftest import start_system
from .clients import second_gateway, stop

STALL_TIMEOUT_S = 3.0


@pytest.fixture(scope="package")
def frontend(smollm_path: str) -> Iterator[System]:
    sys_ = start_system(smollm_path, tokenizer_replicas=2)
    yield sys_
    sys_.stop()


@pytest.fixture(scope="package")
def second(frontend: System) -> Iterator[Child]:
    child = second_gateway(frontend, free_port(), ("--stream-stall-timeout-s", str(STALL_TIMEOUT_S)))
    yield child
    stop(child)


def url_of(child: Child) -> str:
    return f"http://{child.address}"
