"""wire.py: protobuf <-> io_struct round trips, SGLang defaults for unset fields, and the
tracker's ring data (seeds, offsets, resync)."""

from __future__ import annotations

import pytest
from meshlm.scheduler.managers.io_struct import (
    BatchTokenIDOut,
    CloseSessionOutput,
    FlushCacheOutput,
    LoadReport,
    OpenSessionOutput,
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
    pb = common_pb2.SamplingParams(temperature=0.0, top_k=1, max_new_tokens=0, skip_special_tokens=False,
                                   repetition_penalty=0.7, min_p=0.05)
    sp = wire.sampling_params_from_proto(pb)
    assert sp.temperature == 0.0 and sp.top_k == 1 and sp.max_new_tokens == 0
    assert sp.skip_special_tokens is False
    assert sp.repetition_penalty == 0.7 and sp.min_p == 0.05  # float32 shown as the decimal sent


def test_sampling_params_round_trip() -> None:
    sp = SamplingParams(
        max_new_tokens=77, min_new_tokens=3, temperature=0.5, top_p=0.75, top_k=40, min_p=0.1,
        frequency_penalty=0.25, presence_penalty=-0.5, repetition_penalty=1.25, stop=["\n\n", "END"],
        stop_token_ids=[2, 7], ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=False,
        no_stop_trim=True, n=2, logit_bias={5: -100.0, 9: 2.5}, sampling_seed=1234, stream_interval=4,
        json_schema='{"type": "object"}',
    )
    back = wire.sampling_params_from_proto(wire.sampling_params_to_proto(sp))
    assert back == sp
    # a single stop string becomes a one-element list; defaults are not put on the wire
    single = wire.sampling_params_to_proto(SamplingParams(stop="x"))
    assert list(single.stop) == ["x"] and not single.HasField("temperature")


def test_generate_request_round_trip() -> None:
    req = TokenizedGenerateReqInput(
        rid="r1", input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=9),
        input_text="hi", return_logprob=True, logprob_start_len=-1, top_logprobs_num=3,
        token_ids_logprob=[4, 5], stream=True, session_id="s", session_rid="r0",
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


@pytest.mark.parametrize("reason", [
    None,
    {"type": "stop", "matched": 2},
    {"type": "stop", "matched": "\n\n"},
    {"type": "stop", "matched": None},
    {"type": "length", "length": 17},
    {"type": "abort", "message": "bad temperature", "status_code": 400, "err_type": "BadRequestError"},
    {"type": "abort", "message": "Invalid request: session id s does not exist", "status_code": 404,
     "err_type": "NotFoundError"},
    {"type": "abort", "message": "queue full", "status_code": 503, "err_type": "ServiceUnavailableError"},
])
def test_finish_reason_round_trip(reason) -> None:
    pb = wire.finish_reason_to_proto(reason)
    assert wire.finish_reason_from_proto(common_pb2.FinishReason.FromString(pb.SerializeToString())) == reason


def _step(rids, ids, finished=None, logprobs=False) -> BatchTokenIDOut:
    out = BatchTokenIDOut()
    for k, rid in enumerate(rids):
        out.rids.append(rid)
        out.finished_reasons.append((finished or {}).get(rid))
        out.output_ids.append(ids[k])
        out.prompt_tokens.append(4)
        out.completion_tokens.append(len(ids[k]))
        out.cached_tokens.append(1)
        out.retraction_counts.append(0)
        out.prompt_tail_ids.append([])
        if logprobs:
            out.input_token_logprobs.append([None, -1.5, -0.25])
            out.input_token_ids.append([7, 8, 9])
            out.input_top_logprobs.append([[(-0.5, 3)], [(-0.75, 4), (-1.0, 5)]])
            out.input_token_ids_logprobs.append([])
            out.output_token_logprobs.append([-0.125] * len(ids[k]))
            out.output_top_logprobs.append([[(-0.125, t)] for t in ids[k]])
            out.output_token_ids_logprobs.append([[(-2.0, 11)] for _ in ids[k]])
        else:
            for name in ("input_token_logprobs", "input_token_ids", "input_top_logprobs", "input_token_ids_logprobs",
                         "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
                getattr(out, name).append([])
    return out


def test_batch_token_id_out_round_trip_with_logprobs() -> None:
    out = _step(["a", "b"], [[10, 11], [12]], finished={"b": {"type": "length", "length": 1}}, logprobs=True)
    pb = wire.batch_token_id_out_to_proto(
        out, scheduler_id="s0", indices=[0, 1], origins=["t0", "t1"],
        seeds=[wire.decode_seed([1, 2, 3, 4, 5, 6, 7], SamplingParams()), None], token_offsets=[0, 5],
        traces=[None, common_pb2.TraceContext(traceparent="tp")],
    )
    pb = scheduler_pb2.BatchTokenIDOut.FromString(pb.SerializeToString())
    assert list(pb.origins) == ["t0", "t1"] and list(pb.token_offsets) == [0, 5]
    assert pb.seeds[0].present and list(pb.seeds[0].prompt_tail_ids) == [3, 4, 5, 6, 7]
    assert not pb.seeds[1].present and pb.traces[1].traceparent == "tp"
    first = pb.logprobs[0].input_token_logprobs[0]
    assert first.has_logprob is False and first.token_id == 7  # the first prompt token has no logprob
    assert [t.has_logprob for t in pb.logprobs[0].input_token_logprobs] == [False, True, True]
    assert wire.batch_token_id_out_from_proto(pb) == BatchTokenIDOut(
        **{**out.__dict__, "times": [], "prompt_tail_ids": []}
    )


def test_batch_subset_by_indices() -> None:
    out = _step(["a", "b", "c"], [[1], [2], [3]])
    pb = wire.batch_token_id_out_to_proto(
        out, scheduler_id="s", indices=[2], origins=["o"], seeds=[None], token_offsets=[9], traces=[None],
    )
    assert list(pb.rids) == ["c"] and [list(x.ids) for x in pb.output_ids] == [[3]]
    assert pb.logprobs[0] == common_pb2.LogprobDelta()


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
    assert e.error.rid == "r" and e.error.reason.type == common_pb2.FINISH_TYPE_ABORT and e.error.reason.status_code == 503


# ---- tracker --------------------------------------------------------------------------------
def _tracked(rid: str, logprobs: bool = False) -> TrackedRequest:
    return TrackedRequest(
        rid=rid, origin="tok", conn_id=1, trace=common_pb2.TraceContext(),
        seed=wire.decode_seed([1, 2, 3], SamplingParams()), want_logprobs=logprobs,
    )


def test_tracker_offsets_seeds_and_resync() -> None:
    tr = RequestTracker(retention_s=30)
    tr.add(_tracked("a", logprobs=True))
    tr.add(_tracked("b"))
    tr.add(_tracked("quiet"))  # never emits
    pb1, _ = tr.token_out(_step(["a", "b"], [[10], [20]], logprobs=True), "s")
    assert [s.present for s in pb1.seeds] == [True, True] and list(pb1.token_offsets) == [0, 0]
    pb2, _ = tr.token_out(_step(["a", "b"], [[11, 12], [21]], finished={"b": {"type": "length", "length": 2}},
                                logprobs=True), "s")
    assert [s.present for s in pb2.seeds] == [False, False] and list(pb2.token_offsets) == [1, 1]
    assert tr.is_live("a") and not tr.is_live("b") and tr.num_live() == 2
    # outputs after a finish (or for unknown rids) are dropped
    pb3, tracked = tr.token_out(_step(["b", "zzz"], [[99], [98]]), "s")
    assert not pb3.rids and not tracked

    (resync,) = tr.resync("s")
    assert list(resync.rids) == ["a", "b"]  # "quiet" did not emit: it will seed on its first output
    assert all(s.present for s in resync.seeds) and list(resync.token_offsets) == [0, 0]
    assert [list(x.ids) for x in resync.output_ids] == [[10, 11, 12], [20, 21]]
    assert resync.finished_reasons[1].type == common_pb2.FINISH_TYPE_LENGTH
    assert [t.token_id for t in resync.logprobs[0].output_token_logprobs] == [10, 11, 12]
    assert len(resync.logprobs[0].input_token_logprobs) == 6  # accumulated: sent with each step here
    pb4, _ = tr.token_out(_step(["a", "quiet"], [[13], [30]]), "s")
    assert [s.present for s in pb4.seeds] == [False, True] and list(pb4.token_offsets) == [3, 0]

    # finished requests are kept for retention_s, then forgotten
    b = tr.get("b")
    assert b is not None and b.finished_at is not None
    assert tr.expire(b.finished_at + 29) == 0 and tr.expire(b.finished_at + 31) == 1 and tr.get("b") is None


def test_tracker_uses_the_loops_prompt_tail_for_seeds() -> None:
    tr = RequestTracker()
    tr.add(_tracked("turn2"))
    step = _step(["turn2"], [[5]])
    step.prompt_tail_ids[0] = [40, 41, 42, 43, 44]  # a session turn: the loop built the prompt
    pb, _ = tr.token_out(step, "s")
    assert list(pb.seeds[0].prompt_tail_ids) == [40, 41, 42, 43, 44]
