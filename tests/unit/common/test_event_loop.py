"""The processes' asyncio loop is uvloop (a dependency), the standard loop where uvloop cannot
be imported; a serving relay has uvloop loaded (the gateway's uvicorn: test_gateway_app.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from tests.serving import detokenizer_process

from meshlm.common import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_is_on_uvloop() -> None:
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_without_uvloop_run_is_on_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` raise ImportError
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_a_serving_detokenizer_runs_uvloop(smollm_path: str) -> None:
    with detokenizer_process(smollm_path) as (proc, _):
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "uvloop/loop." in maps  # uvloop's extension module is mapped
