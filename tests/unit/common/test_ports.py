"""free_port hands out ports the kernel never picks on its own (below the ephemeral range),
bindable now, and never the same one twice in a process."""

from __future__ import annotations

import socket

import pytest

from meshlm.common import ports
from meshlm.common.ports import ephemeral_low, free_port


def test_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low = ephemeral_low()
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    for port in got:
        assert 1024 < port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        held.listen()
        candidates = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65000)
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(candidates))
        port = free_port()
        assert port != busy


def test_the_kernel_picks_when_no_range_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 1030)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_range_file_missing_falls_back_to_linux_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", "/nonexistent/ip_local_port_range")
    assert ephemeral_low() == 32768
