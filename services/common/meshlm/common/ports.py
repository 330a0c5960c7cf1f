"""Free TCP ports for services that bind them later (the launcher, TP rendezvous, tests).

A port from ``bind(port 0)`` comes out of the kernel's ephemeral range, the same range every
outbound connection draws its local port from. Between handing such a port out and the service
binding it (a scheduler binds only after loading its model, seconds later) any connection on the
host may take it, and the service fails with "Address already in use".

``free_port`` therefore picks from the ports just *below* ``ip_local_port_range``, which the
kernel never assigns on its own, checks that the port is bindable right now, and never hands the
same port out twice in one process. Two processes picking at once may still collide; picking at
random from thousands of ports keeps that unlikely, and the bind check catches ports in use.
"""

from __future__ import annotations

import random
import socket
import threading

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Linux's default ephemeral range starts at 32768; used where /proc does not say.
_DEFAULT_EPHEMERAL_LOW = 32768
# Ports below this are often taken by well-known services (and 1024 is the privileged limit).
_LOWEST = 10000
_SPAN = 12000
_ATTEMPTS = 200

_lock = threading.Lock()
_given: set[int] = set()


def ephemeral_low() -> int:
    """The lowest port the kernel picks for outbound connections and ``bind(0)``."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port bindable on `host` now, outside the ephemeral range, not returned before by this process.

    Falls back to a kernel-chosen port when the range below the ephemeral one is too small (a
    host that made almost every port ephemeral) or every attempt found the port taken.
    """
    high = ephemeral_low()
    low = max(_LOWEST, high - _SPAN)
    with _lock:
        if high - low >= 100:
            for _ in range(_ATTEMPTS):
                port = random.randrange(low, high)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        port = _kernel_port(host)
        _given.add(port)
        return port
