"""The scheduler servicer's parts on their own (no loop, no gRPC): control-call correlation,
request endings and the prefill side of a handover, each wired by constructor as server.py does."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from meshlm.common.finish import FinishReason
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    LoadReport,
    OpenSessionOutput,
    PrefilledReq,
    TokenDelta,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.sampling.sampling_params import SamplingParams
from meshlm.scheduler.service.connections import CLOSED, Connection, ConnectionRegistry
from meshlm.scheduler.service.control import CallKind, ControlCalls
from meshlm.scheduler.service.endings import RequestEnds
from meshlm.scheduler.service.pd_handover import PrefillHandover
from meshlm.scheduler.service.tracker import RequestTracker, TrackedRequest
from meshlm.v1 import common_pb2, scheduler_pb2


def drain_queue(conn: Connection) -> list[Any]:
    out = []
    while not conn.out.empty():
        out.append(conn.out.get_nowait())
    return out


def tracked(rid: str, conn: Connection, finished: bool = False) -> TrackedRequest:
    t = TrackedRequest(
        rid=rid,
        origin=conn.origin,
        conn_id=conn.id,
        trace=common_pb2.TraceContext(),
        seed=scheduler_pb2.DecodeSeed(),
    )
    if finished:
        t.sent = TokenDelta(rid=rid, output_ids=[1], finish_reason=FinishReason.at_length(1))
    conn.rids.add(rid)
    return t


class Recorder:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def __call__(self, item: Any) -> None:
        self.items.append(item)


def test_control_replies_go_to_the_caller_under_its_own_call_id() -> None:
    async def run() -> None:
        put, conns = Recorder(), ConnectionRegistry()
        calls = ControlCalls(put, conns, "s1")
        a, b = conns.open("tok-a"), conns.open("tok-b")
        calls.issue(a, 7, CallKind.FLUSH_CACHE)
        calls.issue(b, 7, CallKind.GET_LOAD)  # same caller id, another stream
        flush, load = put.items
        assert isinstance(flush, FlushCacheReq) and isinstance(load, GetLoadReq)
        assert flush.call_id != load.call_id
        call = calls.resolve(FlushCacheOutput(True, call_id=flush.call_id))
        assert call is not None and call.kind is CallKind.FLUSH_CACHE and call.call_id == 7
        calls.reply(call, FlushCacheOutput(True))
        (reply,) = drain_queue(a)
        assert reply.call_id == 7 and reply.flush_cache.success
        assert drain_queue(b) == []
        assert calls.resolve(FlushCacheOutput(True, call_id=flush.call_id)) is None  # answered once

    asyncio.run(run())


def test_a_crash_answers_every_pending_call() -> None:
    async def run() -> None:
        conns = ConnectionRegistry()
        calls = ControlCalls(Recorder(), conns, "s1")
        a = conns.open("tok-a")
        for i, kind in enumerate(CallKind, start=1):
            msg = scheduler_pb2.SchedulerInput(call_id=i)
            getattr(msg, kind.value).SetInParent()  # the call's own (empty) message
            calls.issue(a, i, kind, msg)
        last = LoadReport(1, 2, 3, 100)
        calls.fail_all("scheduler loop crashed", last)
        replies = {r.call_id: r for r in drain_queue(a)}
        assert set(replies) == {1, 2, 3, 4}
        kinds = {kind: replies[i] for i, kind in enumerate(CallKind, start=1)}
        assert not kinds[CallKind.FLUSH_CACHE].flush_cache.success
        assert "crashed" in kinds[CallKind.FLUSH_CACHE].flush_cache.message
        assert not kinds[CallKind.OPEN_SESSION].open_session.success
        assert kinds[CallKind.CLOSE_SESSION].ack is False
        assert kinds[CallKind.GET_LOAD].load.num_queue_reqs == 2  # the last report seen
        assert calls.resolve(OpenSessionOutput("x", True, call_id=2)) is None

    asyncio.run(run())


class Downstream:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, bool, str]] = []

    def abort(self, rid: str, abort_all: bool, message: str) -> None:
        self.aborts.append((rid, abort_all, message))


def test_fail_aborts_an_unfinished_request_here_and_downstream() -> None:
    async def run() -> None:
        put, tracker, conns, down = Recorder(), RequestTracker(), ConnectionRegistry(), Downstream()
        ends = RequestEnds(put, tracker, conns, downstream=down)
        conn = conns.open("tok")
        live, done = tracked("live", conn), tracked("done", conn, finished=True)
        tracker.add(live)
        tracker.add(done)
        ends.fail(live, "shutting down", 503)
        ends.fail(done, "shutting down", 503)
        assert put.items == [AbortReq(rid="live", message="shutting down")]  # done: nothing to abort
        assert down.aborts == [("live", False, "shutting down")]
        errors = drain_queue(conn)
        assert [e.error.rid for e in errors] == ["live", "done"]
        assert errors[0].error.reason.status_code == 503
        assert len(tracker) == 0 and conn.rids == set()

    asyncio.run(run())


def test_a_decode_rejection_reaches_the_caller_and_done_requests_are_forgotten() -> None:
    async def run() -> None:
        tracker, conns = RequestTracker(), ConnectionRegistry()
        ends = RequestEnds(Recorder(), tracker, conns)
        conn = conns.open("tok")
        tracker.add(tracked("a", conn))
        tracker.add(tracked("b", conn))
        reason = FinishReason.aborted("prompt too long", 400).to_proto()
        ends.reject("a", reason)
        ends.forget(["b", "unknown"])
        (err,) = drain_queue(conn)
        assert err.error.rid == "a" and err.error.reason.message == "prompt too long"
        assert len(tracker) == 0 and conn.rids == set()

    asyncio.run(run())


def test_a_closed_connection_ends_its_output_stream() -> None:
    async def run() -> None:
        conns = ConnectionRegistry()
        a, b = conns.open("a"), conns.open("b")
        conns.remove(b)
        conns.close_all()
        assert drain_queue(a) == [CLOSED] and drain_queue(b) == []
        assert len(conns) == 1 and conns.get(b.id) is None

    asyncio.run(run())


def prefilled(rid: str) -> PrefilledReq:
    req = TokenizedGenerateReqInput(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams())
    return PrefilledReq(req=req, output_ids=[4], kv=torch.zeros(1, 2, 3, 1, 1))


def test_a_handover_with_no_decode_scheduler_up_fails_with_503() -> None:
    async def run() -> None:
        put, tracker, conns = Recorder(), RequestTracker(), ConnectionRegistry()
        local = RequestEnds(put, tracker, conns)
        handover = PrefillHandover("p1", ["127.0.0.1:1"], tracker=tracker, ends=local)
        conn = conns.open("tok")
        t = tracked("r1", conn)
        tracker.add(t)
        handover.hand_over(prefilled("gone"))  # not tracked (failed meanwhile): ignored
        handover.hand_over(prefilled("r1"))
        (err,) = drain_queue(conn)
        assert err.error.rid == "r1" and err.error.reason.status_code == 503
        assert "no decode scheduler reachable" in err.error.reason.message
        assert put.items == [AbortReq(rid="r1", message=err.error.reason.message)]
        await handover.close()

    asyncio.run(run())
