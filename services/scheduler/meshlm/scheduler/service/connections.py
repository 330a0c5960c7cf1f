"""The Connect streams this scheduler serves: one `Connection` per stream, kept in a
`ConnectionRegistry`.

A stream's peer is a tokenizer replica (or, on a decode scheduler, a prefill scheduler). Each
connection remembers the rids sent on it and not finished yet, so that when the stream ends
they are aborted, and an abort_all from that peer covers its own requests only. Owned by the
service's asyncio loop (no locking).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from meshlm.v1 import scheduler_pb2


class Closed:
    """The item that ends a Connect stream's output queue."""


CLOSED = Closed()
Outgoing = scheduler_pb2.SchedulerOutput | Closed


@dataclass
class Connection:
    """One Connect stream. `rids`: requests sent on it, not finished yet. `kv_parts`: KV bytes
    of prefilled requests received so far (decode role), keyed by rid until their PrefilledReq."""

    id: int
    origin: str
    out: asyncio.Queue[Outgoing] = field(default_factory=asyncio.Queue)
    rids: set[str] = field(default_factory=set)
    kv_parts: dict[str, bytearray] = field(default_factory=dict)

    def send(self, msg: scheduler_pb2.SchedulerOutput) -> None:
        self.out.put_nowait(msg)

    def close(self) -> None:
        """End the stream's output after what is queued."""
        self.out.put_nowait(CLOSED)


class ConnectionRegistry:
    def __init__(self) -> None:
        self._conns: dict[int, Connection] = {}
        self._ids = itertools.count(1)

    def open(self, origin: str) -> Connection:
        conn = Connection(next(self._ids), origin)
        self._conns[conn.id] = conn
        return conn

    def remove(self, conn: Connection) -> None:
        self._conns.pop(conn.id, None)

    def get(self, conn_id: int | None) -> Connection | None:
        return self._conns.get(conn_id) if conn_id is not None else None

    def release(self, conn_id: int, rid: str) -> Connection | None:
        """rid is done as far as its stream is concerned; that stream, if still open."""
        conn = self._conns.get(conn_id)
        if conn is not None:
            conn.rids.discard(rid)
        return conn

    def broadcast(self, msg: scheduler_pb2.SchedulerOutput) -> None:
        for conn in self._conns.values():
            conn.send(msg)

    def close_all(self) -> None:
        for conn in list(self._conns.values()):
            conn.close()

    def __iter__(self) -> Iterator[Connection]:
        return iter(list(self._conns.values()))

    def __len__(self) -> int:
        return len(self._conns)
