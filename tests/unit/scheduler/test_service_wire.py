"""wire.py: protobuf <-> io_struct round trips, SGLang defaults for unset fields, finish
reasons, and the tracker's ring data (seeds, offsets, resync)."""

from __future__ import annotations

import grpc
import pytest

from meshlm.common.finish import AbortStatus, FinishKind, FinishReason
from meshlm.scheduler.managers.io_struct import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    CloseSessionOutput,
    EmbeddingOut,
    FlushCacheOutput,
    LoadReport,
    LogprobDelta,
    OpenSessionOutput,
    TokenDelta,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.sampling.sampling_params import SamplingParams
from meshlm.scheduler.service import wire
from meshlm.scheduler.service.tracker import RequestTracker, TrackedRequest
from meshlm.v1 import common_pb2, scheduler_pb2


def test_unset_sampling_fields_are_sglang_defaults() -> None:
    sp = wire.sampling_params_from_proto(common_pb2.SamplingParams())
    assert sp == SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens) == (1.0, 1.0, -1, 128)
    assert sp.skip_special_tokens is True and sp.spaces_between_special_tokens is True
    assert sp.stop is None and sp.stop_token_ids is None and sp.logit_bias is None


def test_set_zero_values_are_kept() -> None:
    pb = common_pb2.SamplingParams(
        temperature=0.0, top_k=1, max_new_tokens=0, skip_special_tokens=False, repetition_penalty=0.7, min_p=0.05
    )
    sp = wire.sampling_params_from_proto(pb)
    assert sp.temperature == 0.0 and sp.top_k == 1 and sp.max_new_tokens == 0
    assert sp.skip_special_tokens is False
    assert sp.repetition_penalty == 0.7 and sp.min_p == 0.05  # float32 shown as the decimal sent


def test_sampling_params_round_trip() -> None:
    sp = SamplingParams(
        max_new_tokens=77,
        min_new_tokens=3,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.1,
        frequency_penalty=0.25,
        presence_penalty=-0.5,
        repetition_penalty=1.25,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 7],
        ignore_eos=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        no_stop_trim=True,
        n=2,
        logit_bias={5: -100.0, 9: 2.5},
        sampling_seed=1234,
        stream_interval=4,
        json_schema='{"type": "object"}',
    )
    back = wire.sampling_params_from_proto(wire.sampling_params_to_proto(sp))
    assert back == sp
    # a single stop string becomes a one-element list; defaults are not put on the wire
    single = wire.sampling_params_to_proto(SamplingParams(stop="x"))
    assert list(single.stop) == ["x"] and not single.HasField("temperature")


def test_generate_request_round_trip() -> None:
    req = TokenizedGenerateReqInput(
        rid="r1",
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.0, max_new_tokens=9),
        input_text="hi",
        return_logprob=True,
        logprob_start_len=-1,
        top_logprobs_num=3,
        token_ids_logprob=[4, 5],
        stream=True,
        session_id="s",
        session_rid="r0",
    )
    trace = common_pb2.TraceContext(traceparent="00-aa-bb-01")
    pb = wire.generate_req_to_proto(req, origin="tok-1", trace=trace)
    assert pb.origin == "tok-1" and pb.trace.traceparent == "00-aa-bb-01"
    back = wire.generate_req_from_proto(scheduler_pb2.TokenizedGenerateReqInput.FromString(pb.SerializeToString()))
    assert back == req
    # no token_ids_logprob vs an empty list; empty strings are None
    plain = wire.generate_req_from_proto(scheduler_pb2.TokenizedGenerateReqInput(rid="r2", input_ids=[1]))
    assert plain.token_ids_logprob is None and plain.session_id is None and plain.input_text is None
    empty = wire.generate_req_from_proto(
        scheduler_pb2.TokenizedGenerateReqInput(rid="r3", input_ids=[1], has_token_ids_logprob=True)
    )
    assert empty.token_ids_logprob == []


@pytest.mark.parametrize(
    "reason",
    [
        FinishReason.stopped(2),
        FinishReason.stopped("\n\n"),
        FinishReason.stopped(None),
        FinishReason.at_length(17),
        FinishReason.aborted("bad temperature", AbortStatus.BAD_REQUEST),
        FinishReason.aborted("Invalid request: session id s does not exist", AbortStatus.NOT_FOUND),
        FinishReason.aborted("queue full", AbortStatus.UNAVAILABLE),
    ],
)
def test_finish_reason_round_trip(reason: FinishReason) -> None:
    pb = common_pb2.FinishReason.FromString(reason.to_proto().SerializeToString())
    assert FinishReason.from_proto(pb) == reason


def test_an_unset_finish_reason_is_not_finished() -> None:
    assert FinishReason.from_proto(common_pb2.FinishReason()) is None
    assert FinishReason.from_proto(scheduler_pb2.TokenDelta().finish_reason) is None


def test_finish_reason_forms_and_errors() -> None:
    """One type decides the SGLang dict and the error an ABORT becomes."""
    assert FinishReason.stopped(2).to_json() == {"type": "stop", "matched": 2}
    assert FinishReason.stopped("END").matched_str == "END" and FinishReason.stopped("END").matched_token is None
    assert FinishReason.at_length(3).to_json() == {"type": "length", "length": 3}
    abort = FinishReason.aborted("queue full", AbortStatus.UNAVAILABLE)
    assert abort.kind is FinishKind.ABORT and abort.is_abort and not abort.is_cancelled
    assert abort.to_json() == {"type": "abort", "message": "queue full", "status_code": 503}
    assert (abort.grpc_code, abort.http_status) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 503)
    cancelled = FinishReason.aborted("Aborted by the client", AbortStatus.CANCELLED)
    assert cancelled.is_cancelled and cancelled.grpc_code == grpc.StatusCode.CANCELLED
    unset = FinishReason.from_proto(common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_ABORT))
    assert unset is not None and unset.grpc_code == grpc.StatusCode.CANCELLED and unset.http_status == 500
    assert FinishReason.aborted("x", AbortStatus.BAD_REQUEST).grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def _delta(rid: str, ids: list[int], finish: FinishReason | None = None, logprobs: bool = False) -> TokenDelta:
    lp = None
    if logprobs:
        lp = LogprobDelta(
            input_token_logprobs=[None, -1.5, -0.25],
            input_token_ids=[7, 8, 9],
            input_top_logprobs=[[(-0.5, 3)], [(-0.75, 4), (-1.0, 5)]],
            output_token_logprobs=[-0.125] * len(ids),
            output_top_logprobs=[[(-0.125, t)] for t in ids],
            output_token_ids_logprobs=[[(-2.0, 11)] for _ in ids],
        )
    return TokenDelta(
        rid=rid,
        output_ids=list(ids),
        finish_reason=finish,
        prompt_tokens=4,
        completion_tokens=len(ids),
        cached_tokens=1,
        logprobs=lp,
    )


def _step(rids, ids, finished=None, logprobs=False) -> BatchTokenIDOut:
    return BatchTokenIDOut([_delta(rid, ids[k], (finished or {}).get(rid), logprobs) for k, rid in enumerate(rids)])


def test_token_delta_round_trip_with_logprobs() -> None:
    delta = _delta("b", [10, 11], FinishReason.at_length(2), logprobs=True)
    delta.retraction_count = 1
    seed = wire.decode_seed([1, 2, 3, 4, 5, 6, 7], SamplingParams())
    pb = wire.token_delta_to_proto(
        delta, origin="t0", token_offset=5, seed=seed, trace=common_pb2.TraceContext(traceparent="tp")
    )
    pb = scheduler_pb2.TokenDelta.FromString(pb.SerializeToString())
    assert (pb.rid, pb.origin, pb.token_offset, pb.trace.traceparent) == ("b", "t0", 5, "tp")
    assert pb.HasField("seed") and list(pb.seed.prompt_tail_ids) == [3, 4, 5, 6, 7]
    first = pb.logprobs.input_token_logprobs[0]
    assert first.has_logprob is False and first.token_id == 7  # the first prompt token has no logprob
    assert [t.has_logprob for t in pb.logprobs.input_token_logprobs] == [False, True, True]
    assert [t.token_id for t in pb.logprobs.output_token_logprobs] == [10, 11]
    assert wire.token_delta_from_proto(pb) == delta


def test_a_running_delta_without_logprobs_leaves_its_fields_unset() -> None:
    pb = wire.token_delta_to_proto(_delta("a", [3]), origin="o", token_offset=9, seed=None, trace=None)
    assert not pb.HasField("seed") and not pb.HasField("finish_reason") and not pb.HasField("logprobs")
    assert list(pb.output_ids) == [3] and wire.token_delta_from_proto(pb).logprobs is None


def test_control_replies() -> None:
    load = LoadReport(2, 3, 100, 1000, 0.5, 0.1, max_running_requests=64, call_id=9)
    r = wire.control_reply(7, load, "sched")
    assert r.call_id == 7 and r.load.scheduler_id == "sched" and r.load.num_queue_reqs == 3
    assert r.load.max_running_requests == 64 and r.load.token_usage == pytest.approx(0.1)
    assert wire.control_reply(1, FlushCacheOutput(False, "busy"), "s").flush_cache.message == "busy"
    o = wire.control_reply(2, OpenSessionOutput("sid", True), "s")
    assert o.open_session.session_id == "sid" and o.open_session.success
    c = wire.control_reply(3, CloseSessionOutput("sid", False, "no"), "s")
    assert c.WhichOneof("msg") == "ack" and c.ack is False
    e = wire.request_error("r", "no detokenizer reachable", 503)
    assert (
        e.error.rid == "r" and e.error.reason.type == common_pb2.FINISH_TYPE_ABORT and e.error.reason.status_code == 503
    )


# ---- tracker --------------------------------------------------------------------------------
def _tracked(rid: str, embedding: bool = False) -> TrackedRequest:
    return TrackedRequest(
        rid=rid,
        origin="tok",
        conn_id=1,
        trace=common_pb2.TraceContext(),
        seed=wire.decode_seed([1, 2, 3], SamplingParams()),
        is_embedding=embedding,
    )


def test_tracker_offsets_seeds_and_resync() -> None:
    tr = RequestTracker(retention_s=30)
    tr.add(_tracked("a"))
    tr.add(_tracked("b"))
    tr.add(_tracked("quiet"))  # never emits
    pb1, _ = tr.token_out(_step(["a", "b"], [[10], [20]], logprobs=True), "s")
    assert [d.HasField("seed") for d in pb1.deltas] == [True, True]
    assert [d.token_offset for d in pb1.deltas] == [0, 0]
    pb2, _ = tr.token_out(
        _step(["a", "b"], [[11, 12], [21]], finished={"b": FinishReason.at_length(2)}, logprobs=True), "s"
    )
    assert [d.HasField("seed") for d in pb2.deltas] == [False, False]
    assert [d.token_offset for d in pb2.deltas] == [1, 1]
    assert tr.is_live("a") and not tr.is_live("b") and tr.num_live() == 2
    # outputs after a finish (or for unknown rids) are dropped
    pb3, tracked = tr.token_out(_step(["b", "zzz"], [[99], [98]]), "s")
    assert not pb3.deltas and not tracked

    (resync,) = tr.resync("s")
    assert [d.rid for d in resync.deltas] == ["a", "b"]  # "quiet" did not emit: it will seed on its first output
    assert all(d.HasField("seed") for d in resync.deltas) and [d.token_offset for d in resync.deltas] == [0, 0]
    assert [list(d.output_ids) for d in resync.deltas] == [[10, 11, 12], [20, 21]]
    assert resync.deltas[1].finish_reason.type == common_pb2.FINISH_TYPE_LENGTH
    assert not resync.deltas[0].HasField("finish_reason")
    assert [t.token_id for t in resync.deltas[0].logprobs.output_token_logprobs] == [10, 11, 12]
    assert len(resync.deltas[0].logprobs.input_token_logprobs) == 6  # accumulated: sent with each step here
    pb4, _ = tr.token_out(_step(["a", "quiet"], [[13], [30]]), "s")
    assert [d.HasField("seed") for d in pb4.deltas] == [False, True]
    assert [d.token_offset for d in pb4.deltas] == [3, 0]

    # finished requests are kept for retention_s, then forgotten
    b = tr.get("b")
    assert b is not None and b.finished_at is not None
    assert tr.expire(b.finished_at + 29) == 0 and tr.expire(b.finished_at + 31) == 1 and tr.get("b") is None


def test_tracker_resync_resends_the_same_message_as_the_steps() -> None:
    """The resync's delta is built by the same builder: with one step, it equals that step's delta."""
    tr = RequestTracker()
    tr.add(_tracked("a"))
    step, _ = tr.token_out(_step(["a"], [[5, 6]], finished={"a": FinishReason.stopped(6)}, logprobs=True), "s")
    (resync,) = tr.resync("s")
    assert resync.deltas[0] == step.deltas[0]


def test_tracker_embeddings_and_rejected_embeddings() -> None:
    tr = RequestTracker()
    tr.add(_tracked("e", embedding=True))
    tr.add(_tracked("bad", embedding=True))
    pb, tracked = tr.embedding_out(
        BatchEmbeddingOut([EmbeddingOut("e", [0.5, -1.0], 3, FinishReason.at_length(0))]), "s"
    )
    assert [r.rid for r in pb.results] == ["e"] and list(pb.results[0].embedding) == [0.5, -1.0]
    assert pb.results[0].origin == "tok" and tracked[0].finished
    # the loop rejects an embedding request with a token delta
    tr.token_out(_step(["bad"], [[]], finished={"bad": FinishReason.aborted("input must not be empty")}), "s")
    tokens, embeds = tr.resync("s")
    assert [d.rid for d in tokens.deltas] == ["bad"] and tokens.deltas[0].finish_reason.status_code == 400
    assert [r.rid for r in embeds.results] == ["e"] and embeds.results[0].prompt_tokens == 3


def test_tracker_uses_the_loops_prompt_tail_for_seeds() -> None:
    tr = RequestTracker()
    tr.add(_tracked("turn2"))
    step = _step(["turn2"], [[5]])
    step.deltas[0].prompt_tail_ids = [40, 41, 42, 43, 44]  # a session turn: the loop built the prompt
    pb, _ = tr.token_out(step, "s")
    assert list(pb.deltas[0].seed.prompt_tail_ids) == [40, 41, 42, 43, 44]
