"""gRPC's socket layer for the ring's processes: the classic pollers, not the EventEngine's.

From grpcio 1.60 on, gRPC moves every socket event through its EventEngine: one thread polls,
another from a work-stealing pool runs the callback, and the completion reaches Python's poller
thread and then the asyncio loop. Each hop wakes a thread. A unary call on loopback costs 14
context switches that way against 6 with the classic endpoints (`GRPC_EXPERIMENTS=
-event_engine_client,-event_engine_listener`), where the thread that polls the completion queue
also does the socket I/O. On a machine whose cores the scheduler's OpenMP threads fill, every
relay wake-up preempts one of them and stalls the other at its next barrier: with the classic
endpoints the tokenizer, detokenizer and gateway woke about half as often per output token at
c=64 and spent ~9% less CPU on it (bench/ring_cpu.py, bench/README.md).

gRPC reads GRPC_EXPERIMENTS once, when it loads, so this must run before anything imports grpc:
first thing in each entry point (`meshlm`, `python -m meshlm.<component>`); `meshlm launch`'s
services inherit it. A GRPC_EXPERIMENTS already set is kept (set it empty for gRPC's defaults).
"""

from __future__ import annotations

import os
import sys

CLASSIC_ENDPOINTS = "-event_engine_client,-event_engine_listener"


def prefer_classic_endpoints() -> bool:
    """Default GRPC_EXPERIMENTS to CLASSIC_ENDPOINTS; True when gRPC will load with it (it is
    not loaded yet, and the environment did not choose otherwise)."""
    if "grpc" in sys.modules:
        return False  # too late for this process (it only sets the default for its children)
    return os.environ.setdefault("GRPC_EXPERIMENTS", CLASSIC_ENDPOINTS) == CLASSIC_ENDPOINTS
