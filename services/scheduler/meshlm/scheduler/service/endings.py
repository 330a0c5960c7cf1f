"""RequestEnds: how a request ends outside the ring (the loop's own outputs end the rest).

  * abort: the loop stops the request and frees its KV (it reports the abort as the request's
    finish through the detokenizer); a request handed to a decode scheduler is aborted there too
    (`downstream`, prefill role);
  * fail: the request is forgotten here and gets an early error on its Connect stream, and is
    aborted in the loop if it had not finished;
  * reject / forget: a decode scheduler rejected, or finished, a request handed to it.

Nothing is lost: every tracked request leaves through the loop's finish or one of these. Owned
by the service's asyncio loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from meshlm.scheduler.managers.io_struct import AbortReq
from meshlm.scheduler.service import wire
from meshlm.scheduler.service.connections import ConnectionRegistry
from meshlm.scheduler.service.tracker import RequestTracker, TrackedRequest
from meshlm.v1 import common_pb2, scheduler_pb2


class Downstream(Protocol):
    """Where requests of this scheduler continue (the decode schedulers, prefill role)."""

    def abort(self, rid: str, abort_all: bool, message: str) -> None: ...


class RequestEnds:
    def __init__(
        self,
        put: Callable[[Any], None],
        tracker: RequestTracker,
        connections: ConnectionRegistry,
        downstream: Downstream | None = None,
    ) -> None:
        self._put = put
        self._tracker = tracker
        self._connections = connections
        self._downstream = downstream

    def abort(self, rid: str, message: str, abort_all: bool = False) -> None:
        """Abort in this loop and, for requests handed to a decode scheduler, there too."""
        self._put(AbortReq(rid=rid, abort_all=abort_all, message=message))
        t = self._tracker.get(rid)
        if t is not None:
            t.abort_requested = True
        if self._downstream is not None:
            self._downstream.abort(rid, abort_all, message)

    def fail(self, t: TrackedRequest, message: str, status_code: int) -> None:
        """End t with an error on its Connect stream (aborted in the loop if unfinished)."""
        self._tracker.remove(t.rid)
        if not t.finished:
            self.abort(t.rid, message)
        conn = self._connections.release(t.conn_id, t.rid)
        if conn is not None:
            conn.send(wire.request_error(t.rid, message, status_code))

    def fail_rids(self, rids: list[str], message: str, status_code: int) -> None:
        """fail() each of rids still tracked."""
        for rid in rids:
            t = self._tracker.get(rid)
            if t is not None:
                self.fail(t, message, status_code)

    def fail_live(self, message: str, status_code: int) -> None:
        for t in self._tracker.live():
            self.fail(t, message, status_code)

    def reject(self, rid: str, reason: common_pb2.FinishReason) -> None:
        """A decode scheduler rejected rid: its error (the decode side's reason) goes to the caller."""
        t = self._tracker.remove(rid)
        conn = self._connections.release(t.conn_id, rid) if t is not None else None
        if conn is not None:
            conn.send(scheduler_pb2.SchedulerOutput(error=scheduler_pb2.RequestError(rid=rid, reason=reason)))

    def forget(self, rids: list[str]) -> None:
        """A decode scheduler finished these requests (their outputs went the decode side's way)."""
        for rid in rids:
            t = self._tracker.remove(rid)
            if t is not None:
                self._connections.release(t.conn_id, rid)
