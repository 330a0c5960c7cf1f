"""The scheduler side of a tokenizer replica: which scheduler takes a request, sending it there,
and what a scheduler's Connect stream reports (connected, load, a request's error, lost).

When a request's scheduler is lost, is not connected at send, or refuses or ends it with status
503 (draining, no detokenizer, its decode scheduler went away), the request moves:

* one that produced nothing yet, was not retried and is not in a session moves once to another
  connected scheduler as `<rid>_retry` (a fresh wire rid, so a late abort from the lost
  scheduler cannot hit the retry);
* one that produced output migrates (migration.py) as `<rid>_m<k>`, up to migration_limit times,
  to another connected scheduler, or to the same one when that scheduler is alive and reported
  the error itself (a prefill scheduler whose decode scheduler went away re-prefills it);
* otherwise it fails with UNAVAILABLE naming why. Sessions never move.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from meshlm.common.channels import Dialer
from meshlm.common.errors import ServiceError
from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.inflight import InFlight
from meshlm.tokenizer.migration import MigrationPolicy
from meshlm.tokenizer.routing import Router, session_scheduler
from meshlm.tokenizer.scheduler_client import SchedulerConnection, SchedulerPool
from meshlm.tokenizer.state import Delta, DeltaEvent, EmbeddingEvent, ReqKind, ReqState, error_reason
from meshlm.v1 import common_pb2, scheduler_pb2

logger = logging.getLogger(__name__)


class Dispatcher:
    """Implements scheduler_client.SchedulerEvents for its pool; on_connected runs after every
    (re)connect (the model may have changed with the scheduler)."""

    def __init__(
        self,
        config: TokenizerConfig,
        inflight: InFlight,
        on_connected: Callable[[], None],
        dialer: Dialer | None = None,
    ) -> None:
        self.inflight = inflight
        self.router = Router(config.routing_policy)
        self.migration = MigrationPolicy(config.migration_limit)
        self.schedulers = SchedulerPool(config.scheduler_addrs, config.tokenizer_id, self, dialer=dialer)
        self._on_connected = on_connected

    def _load_of(self, index: int) -> common_pb2.SchedulerLoad | None:
        conn = self.schedulers.get(index)
        return conn.load if conn is not None else None

    def route(self, session_id: str = "") -> SchedulerConnection:
        """The scheduler for a new request: the session's, or one the policy picks."""
        if session_id:
            j = session_scheduler(session_id, len(self.schedulers))
            conn = self.schedulers.get(j) if j is not None else None
            if conn is None:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"session_id {session_id!r} is unknown")
            if not conn.connected:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the scheduler of session {session_id!r} ({conn.address}) is not connected",
                )
            return conn
        connected = self.schedulers.connected()
        if not connected:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no scheduler is connected")
        return self._pick(connected)

    def _pick(self, indices: list[int]) -> SchedulerConnection:
        """The policy's choice among connected scheduler indices (the pool holds each of them)."""
        conn = self.schedulers.get(self.router.choose(indices, self._load_of))
        assert conn is not None, "the router chose an index the pool does not hold"
        return conn

    def send(self, state: ReqState) -> None:
        field = "embed" if state.kind is ReqKind.EMBED else "generate"
        if not state.conn.send(scheduler_pb2.SchedulerInput(**{field: state.req})):
            self.reroute_or_fail(state, f"scheduler {state.conn.address} is not connected")

    def _others(self, conn: SchedulerConnection) -> list[int]:
        return [i for i in self.schedulers.connected() if self.schedulers.get(i) is not conn]

    def reroute_or_fail(self, state: ReqState, why: str, alive: SchedulerConnection | None = None) -> None:
        """Retry (nothing produced yet) or migrate (output produced) elsewhere, else UNAVAILABLE.
        alive: the scheduler that reported the error itself (still connected): a migration may
        go back to it when no other scheduler is connected."""
        refusal = self._refusal(state, alive)
        if refusal is not None:
            self.inflight.fail(state, ServiceError(grpc.StatusCode.UNAVAILABLE, f"{why}; {refusal}"))
            return
        others = self._others(state.conn)
        conn = self._pick(others) if others else alive
        assert conn is not None, "_refusal allows a move only with a target"
        if state.produced:
            rid = self.migration.prepare(state)
            self.inflight.metrics.num_migrated_requests.inc()
            logger.warning(
                "%s; migrating %s to scheduler %s after %d tokens",
                why,
                state.public_rid,
                conn.address,
                len(state.received.ids),
            )
        else:
            rid, state.retried = f"{state.public_rid}_retry", True
            logger.warning("%s; retrying %s on scheduler %s", why, state.public_rid, conn.address)
        self.inflight.rekey(state, rid)
        state.conn = conn
        self.send(state)

    def _refusal(self, state: ReqState, alive: SchedulerConnection | None) -> str | None:
        """Why the request cannot move (None: it can, and there is a target)."""
        if state.session_id:
            return "session requests stay on their scheduler"
        if state.produced:
            refusal = self.migration.refusal(state)
            if refusal is not None:
                return f"not migrated: {refusal}"
        elif state.retried:
            return "it was retried once already"
        if not self._others(state.conn) and (alive is None or not state.produced or not alive.connected):
            return "no other scheduler is connected"
        return None

    # ---- scheduler stream events (scheduler_client.SchedulerEvents) -----------------------
    def on_scheduler_connected(self, conn: SchedulerConnection) -> None:
        self._on_connected()

    def on_scheduler_load(self, conn: SchedulerConnection) -> None:
        self.router.on_load(conn.index)

    def on_scheduler_error(self, conn: SchedulerConnection, error: scheduler_pb2.RequestError) -> None:
        state = self.inflight.states.get(error.rid)
        if state is None:
            return
        reason = error_reason(error)
        if reason.status_code == 503 and self._refusal(state, conn) is None:
            # Draining, without a detokenizer, or its decode scheduler went away: move it.
            self.reroute_or_fail(state, f"scheduler {conn.address} ended {state.public_rid}: {reason.message}", conn)
            return
        self.inflight.pop(state)
        if state.kind is ReqKind.EMBED:
            state.call.queue.put_nowait(EmbeddingEvent(state, [], reason))
            return
        if state.kind is ReqKind.GENERATE:
            self.inflight.metrics.observe_finish(state, reason, time.monotonic())
        state.call.queue.put_nowait(DeltaEvent(state, Delta("", [], None, reason)))

    def on_scheduler_lost(self, conn: SchedulerConnection, reason: str) -> None:
        for state in [s for s in self.inflight.states.values() if s.conn is conn]:
            self.reroute_or_fail(state, f"scheduler {conn.address} connection lost ({reason})")
