"""LoadReporter: the scheduler's load, as its tokenizers see it.

Every Connect stream gets a load report when it opens (its own get_load call) and then
periodically: every `interval_s` while requests are live or queued, every
IDLE_LOAD_FACTOR intervals when idle, none once the loop crashed. The periodic tick also
expires finished requests from the tracker. The latest report feeds the metrics and answers
get_load calls after a crash. Owned by the service's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshlm.scheduler.managers.io_struct import LoadReport
from meshlm.scheduler.service import wire
from meshlm.scheduler.service.connections import Connection, ConnectionRegistry
from meshlm.scheduler.service.control import CallKind, ControlCalls
from meshlm.scheduler.service.lifecycle import ServiceState
from meshlm.scheduler.service.observability import SchedulerMetrics
from meshlm.scheduler.service.tracker import RequestTracker
from meshlm.v1 import scheduler_pb2

logger = logging.getLogger(__name__)

IDLE_LOAD_FACTOR = 4  # idle: a load report every 4 intervals (0.5 s busy -> 2 s idle)


class LoadReporter:
    def __init__(
        self,
        scheduler_id: str,
        *,
        calls: ControlCalls,
        connections: ConnectionRegistry,
        tracker: RequestTracker,
        state: ServiceState,
        metrics: SchedulerMetrics | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self.scheduler_id = scheduler_id
        self.interval_s = interval_s
        self.last: LoadReport | None = None
        self._calls = calls
        self._connections = connections
        self._tracker = tracker
        self._state = state
        self._metrics = metrics
        self._last_broadcast = 0.0

    def request(self, conn: Connection | None) -> None:
        """Ask the loop for its load, for conn (None: every stream)."""
        self._calls.issue(conn, 0, CallKind.GET_LOAD)

    def record(self, report: LoadReport) -> None:
        """Every load report the loop sends passes here."""
        self.last = report
        if self._metrics is not None:
            self._metrics.update_load(report)

    def broadcast(self, report: LoadReport) -> None:
        self._last_broadcast = time.monotonic()
        self._connections.broadcast(scheduler_pb2.SchedulerOutput(load=wire.load_to_proto(report, self.scheduler_id)))

    def _busy(self) -> bool:
        last = self.last
        return self._tracker.num_live() > 0 or (last is not None and bool(last.num_running_reqs or last.num_queue_reqs))

    async def run(self) -> None:
        """The periodic report (a task of the servicer)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self._tracker.expire()
                if self._state.crashed or not len(self._connections):
                    continue
                idle_due = time.monotonic() - self._last_broadcast >= self.interval_s * IDLE_LOAD_FACTOR
                if self._busy() or idle_due:
                    self.request(None)
            except Exception:
                logger.exception("load reporter")
