"""Prefill/decode disaggregation, the scheduler service's two halves of a handover.

Prefill role (`PrefillHandover`): the loop emits a PrefilledReq for each prompt it computed;
it goes to a decode scheduler through a `DecodeHandoffClient` (handoff.py) and stays tracked
here, aborts forwarded (`abort`, the `Downstream` of RequestEnds), until that scheduler reports
it done (forgotten), rejects it (its error goes to the tokenizer) or goes away (503). A request
whose handover cannot start (aborted meanwhile, no decode scheduler up) fails at once.

Decode role (add_kv_chunk, take_prefilled, report_done): a prefill scheduler's Connect stream
carries kv_chunk messages then the PrefilledReq of each request; the request is then tracked
like any other (outputs to its detokenizer, routed by its origin) and, when it finishes,
handover_done tells the prefill scheduler on that stream. Owned by the service's asyncio loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshlm.common.tls import TlsConfig
from meshlm.scheduler.managers.io_struct import PrefilledReq
from meshlm.scheduler.service.connections import Connection
from meshlm.scheduler.service.endings import RequestEnds
from meshlm.scheduler.service.handoff import DecodeHandoffClient
from meshlm.scheduler.service.handoff_wire import prefilled_from_proto
from meshlm.scheduler.service.tracker import RequestTracker
from meshlm.v1 import scheduler_pb2


class PrefillHandover:
    """ends: this scheduler's RequestEnds without a downstream (a request whose handover
    failed, or whose decode scheduler went away, has nothing left to abort there)."""

    def __init__(
        self,
        scheduler_id: str,
        decode_addrs: Sequence[str],
        *,
        tracker: RequestTracker,
        ends: RequestEnds,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.scheduler_id = scheduler_id
        self._tracker = tracker
        self._ends = ends
        self.client = DecodeHandoffClient(
            scheduler_id,
            decode_addrs,
            on_error=ends.reject,
            on_lost=self._lost,
            on_done=ends.forget,
            tls=tls,
            token=token,
        )

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.client.start()

    async def close(self) -> None:
        await self.client.close()

    def any_up(self) -> bool:
        return self.client.any_up()

    async def wait_up(self, timeout: float) -> bool:
        return await self.client.wait_up(timeout)

    # ---- requests -----------------------------------------------------------------------
    def hand_over(self, msg: PrefilledReq) -> None:
        t = self._tracker.get(msg.req.rid)
        if t is None or t.finished:
            return  # failed meanwhile: its KV is already back in this scheduler's pool
        if t.abort_requested:
            return self._ends.fail(t, "Aborted by the client", 499)
        endpoint = self.client.hand_over(msg, t.origin, t.trace)
        if endpoint is None:
            return self._ends.fail(t, f"scheduler {self.scheduler_id}: no decode scheduler reachable", 503)
        t.handed_to = endpoint

    def abort(self, rid: str, abort_all: bool, message: str) -> None:
        """Forward an abort to the decode schedulers carrying rid (or all, abort_all)."""
        self.client.abort(rid, abort_all, message)

    def _lost(self, rids: list[str], message: str) -> None:
        self._ends.fail_rids(rids, message, 503)


# ---- decode role: a prefill scheduler's Connect stream ----------------------------------
def add_kv_chunk(conn: Connection, chunk: scheduler_pb2.KvChunk) -> None:
    conn.kv_parts.setdefault(chunk.rid, bytearray()).extend(chunk.data)


def take_prefilled(conn: Connection, pb: scheduler_pb2.PrefilledReq) -> PrefilledReq:
    """The PrefilledReq with the KV received for it on conn; ValueError when they do not fit."""
    return prefilled_from_proto(pb, conn.kv_parts.pop(pb.req.rid, bytearray()))


def report_done(conn: Connection, rids: list[str]) -> None:
    """rids (handed over on conn) finished here: the prefill scheduler forgets them."""
    conn.send(scheduler_pb2.SchedulerOutput(handover_done=scheduler_pb2.HandoverDone(rids=rids)))
