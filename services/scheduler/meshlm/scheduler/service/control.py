"""Control calls: flush_cache, open_session, close_session and get_load, correlated between a
Connect stream and the scheduler loop.

A peer numbers its calls (call_id); two peers may use the same numbers, so each call gets an
internal id for the loop, and the loop's reply (carrying that id) is routed back to the
caller's stream under the caller's call_id. A call with no stream (conn_id None) is the
service's own periodic load request. When the loop crashed, every call still waiting, and
every new one, is answered with a failure instead. Owned by the service's asyncio loop.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshlm.scheduler.managers.io_struct import (
    CloseSessionOutput,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    LoadReport,
    OpenSessionOutput,
)
from meshlm.scheduler.service import wire
from meshlm.scheduler.service.connections import Connection, ConnectionRegistry
from meshlm.v1 import scheduler_pb2

logger = logging.getLogger(__name__)


class CallKind(enum.Enum):
    FLUSH_CACHE = "flush_cache"
    OPEN_SESSION = "open_session"
    CLOSE_SESSION = "close_session"
    GET_LOAD = "get_load"


@dataclass(frozen=True)
class PendingCall:
    conn_id: int | None  # None: the service's own (periodic load)
    call_id: int  # the caller's
    kind: CallKind


def loop_request(kind: CallKind, msg: scheduler_pb2.SchedulerInput | None, internal_id: int) -> Any:
    """The loop's io_struct request for a control call of `kind` (msg: the peer's message; the
    session calls need it, the service's own get_load has none)."""
    if kind is CallKind.FLUSH_CACHE:
        return FlushCacheReq(call_id=internal_id)
    if kind is CallKind.GET_LOAD:
        return GetLoadReq(call_id=internal_id)
    assert msg is not None, kind
    if kind is CallKind.OPEN_SESSION:
        return wire.open_session_from_proto(msg.open_session, internal_id)
    return wire.close_session_from_proto(msg.close_session, internal_id)


def failed_reply(kind: CallKind, message: str, last_load: LoadReport | None) -> Any:
    """What a call the loop cannot answer gets (None: nothing to say, get_load before any report)."""
    if kind is CallKind.FLUSH_CACHE:
        return FlushCacheOutput(False, message)
    if kind is CallKind.OPEN_SESSION:
        return OpenSessionOutput(None, False, message)
    if kind is CallKind.CLOSE_SESSION:
        return CloseSessionOutput("", False, message)
    return last_load


class ControlCalls:
    """The control calls sent to the loop and not answered yet."""

    def __init__(self, put: Callable[[Any], None], connections: ConnectionRegistry, scheduler_id: str) -> None:
        self._put = put
        self._connections = connections
        self._scheduler_id = scheduler_id
        self._pending: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)

    def issue(
        self, conn: Connection | None, call_id: int, kind: CallKind, msg: scheduler_pb2.SchedulerInput | None = None
    ) -> None:
        """Send the call to the loop; its reply goes to conn (None: the service) under call_id."""
        internal = next(self._ids)
        self._pending[internal] = PendingCall(conn.id if conn is not None else None, call_id, kind)
        self._put(loop_request(kind, msg, internal))

    def resolve(self, msg: Any) -> PendingCall | None:
        """The call a loop reply answers (it is no longer pending), or None."""
        call = self._pending.pop(getattr(msg, "call_id", 0), None)
        if call is None:
            logger.warning("control reply %s matches no call", type(msg).__name__)
        return call

    def reply(self, call: PendingCall, msg: Any) -> None:
        conn = self._connections.get(call.conn_id)
        if conn is not None:
            conn.send(wire.control_reply(call.call_id, msg, self._scheduler_id))

    def refuse(
        self, conn: Connection, call_id: int, kind: CallKind, message: str, last_load: LoadReport | None
    ) -> None:
        """Answer a call the loop cannot answer (it crashed)."""
        out = failed_reply(kind, message, last_load)
        if out is not None:
            conn.send(wire.control_reply(call_id, out, self._scheduler_id))

    def fail_all(self, message: str, last_load: LoadReport | None) -> None:
        """The loop crashed: answer every pending call with a failure."""
        pending, self._pending = self._pending, {}
        for call in pending.values():
            conn = self._connections.get(call.conn_id)
            if conn is not None:
                self.refuse(conn, call.call_id, call.kind, message, last_load)
