"""Contract of meshlm.v1.SchedulerService over real gRPC (docs/ring.md): a real scheduler
service (tiny random Llama, real SmolLM2 tokenizer) driven through Connect like a tokenizer,
pushing to in-test recording detokenizers. Failures and the process: test_scheduler_failover_contract.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.common import protocol
from meshlm.common.protocol import PROTOCOL_VERSION
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.spans import capture_spans

from .scheduler_harness import (
    PROMPT,
    SERVICE,
    RecordingDetokenizer,
    ServiceThread,
    TokenizerStream,
    build_tiny_llama,
    greedy,
    tiny_service,
    wait_idle,
    wait_until,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_path: str) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm_path)


@pytest.fixture(scope="module")
def detok() -> Iterator[RecordingDetokenizer]:
    d = RecordingDetokenizer()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def service(tiny_llama: str, detok: RecordingDetokenizer) -> Iterator[ServiceThread]:
    s = tiny_service(tiny_llama, "sched-test", (detok.address,), load_report_interval_s=0.2)
    yield s
    s.stop()


@pytest.fixture
def tok(service: ServiceThread, request: pytest.FixtureRequest) -> Iterator[TokenizerStream]:
    t = TokenizerStream(service.address, f"tok-{request.node.name}")
    yield t
    t.cancel()


# ---- service basics ---------------------------------------------------------------------------
def test_health_reflection_and_model_info(service: ServiceThread, tiny_llama: str) -> None:
    with grpc.insecure_channel(service.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=name)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        assert SERVICE in {s.name for s in resp.list_services_response.service}
        info = scheduler_pb2_grpc.SchedulerServiceStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest())
    assert info.is_generation and info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == 49152 and info.context_length == 2048 and list(info.eos_token_ids) == [2]
    assert info.max_req_input_len == 2047 and Path(info.model_path) == Path(tiny_llama)


def test_connect_sends_load_and_answers_controls_by_call_id(tok: TokenizerStream) -> None:
    first = tok.wait_output(lambda o: True, what="the first output")
    assert first.WhichOneof("msg") == "load" and first.call_id == 0
    assert first.load.scheduler_id == "sched-test" and first.load.max_total_num_tokens == 4096
    assert first.load.max_running_requests > 0
    # Several calls in flight: each reply carries its own call_id.
    tok.send(call_id=41, get_load=scheduler_pb2.GetLoadReq())
    tok.send(call_id=42, flush_cache=scheduler_pb2.FlushCacheReq())
    tok.send(call_id=43, close_session=scheduler_pb2.CloseSessionReq(session_id="never-opened"))
    tok.send(call_id=44, abort=scheduler_pb2.AbortReq(rid="nothing-to-abort"))
    r41 = tok.wait_output(lambda o: o.call_id == 41)
    r42 = tok.wait_output(lambda o: o.call_id == 42)
    r43 = tok.wait_output(lambda o: o.call_id == 43)
    r44 = tok.wait_output(lambda o: o.call_id == 44)
    assert r41.WhichOneof("msg") == "load"
    assert r42.WhichOneof("msg") == "flush_cache" and r42.flush_cache.success
    assert r43.WhichOneof("msg") == "ack" and r43.ack is False  # no such session
    assert r44.WhichOneof("msg") == "ack" and r44.ack is True
    # Periodic loads keep coming (0.2 s busy, 0.8 s idle in this service).
    n = sum(o.WhichOneof("msg") == "load" and o.call_id == 0 for o in tok.snapshot())
    wait_until(
        lambda: sum(o.WhichOneof("msg") == "load" and o.call_id == 0 for o in tok.snapshot()) > n,
        3.0,
        "a periodic load report",
    )


def _connect_raw(address: str, first: bytes) -> grpc.RpcError:
    """Open Connect with `first` as raw bytes (any peer, any protocol) and return its error."""
    with grpc.insecure_channel(address) as ch:
        connect = ch.stream_stream(
            f"/{SERVICE}/Connect",
            request_serializer=lambda b: b,
            response_deserializer=scheduler_pb2.SchedulerOutput.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            list(connect(iter([first]), timeout=10))
    return e.value


def test_first_message_must_be_hello(service: ServiceThread) -> None:
    err = _connect_raw(
        service.address, scheduler_pb2.SchedulerInput(get_load=scheduler_pb2.GetLoadReq()).SerializeToString()
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be hello" in err.details()
    nameless = scheduler_pb2.SchedulerInput(hello=protocol.hello(""))
    assert _connect_raw(service.address, nameless.SerializeToString()).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_peer_of_another_protocol_version_is_refused(service: ServiceThread) -> None:
    newer = scheduler_pb2.SchedulerInput(
        hello=common_pb2.Hello(peer_id="tok-new", protocol_version=PROTOCOL_VERSION + 1)
    )
    err = _connect_raw(service.address, newer.SerializeToString())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"speaks meshlm.v1 ring protocol {PROTOCOL_VERSION + 1}" in err.details()
    assert f"this scheduler speaks {PROTOCOL_VERSION}" in err.details()
    # A protocol-1 tokenizer opened with `string hello_origin = 9` (field 9, wire type 2).
    old = bytes([9 << 3 | 2, len(b"tok-old")]) + b"tok-old"
    err = _connect_raw(service.address, old)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol 1" in err.details() and f"speaks {PROTOCOL_VERSION}" in err.details()


# ---- the ring ---------------------------------------------------------------------------------
def test_generate_reaches_detokenizer_with_origin_seed_offsets(
    tok: TokenizerStream, detok: RecordingDetokenizer
) -> None:
    rid = "gen-stream"
    tok.generate(
        rid,
        PROMPT,
        sampling_params=greedy(12, skip_special_tokens=False),
        stream=True,
        trace=common_pb2.TraceContext(traceparent=TRACEPARENT),
    )
    finish = detok.wait_finish(rid)
    assert detok.hello().peer_id == "sched-test"
    entries = detok.entries(rid)
    assert len(entries) >= 2  # streamed: one delta per step
    assert {e["origin"] for e in entries} == {tok.origin}
    assert {e["scheduler_id"] for e in entries} == {"sched-test"}
    seed = entries[0]["seed"]
    assert entries[0]["seeded"] and list(seed.prompt_tail_ids) == PROMPT[-5:]
    assert seed.skip_special_tokens is False and seed.spaces_between_special_tokens is True
    assert not any(e["seeded"] for e in entries[1:])
    offset = 0
    for e in entries:  # contiguous deltas
        assert e["offset"] == offset
        offset += len(e["ids"])
    assert offset == 12
    assert finish.type == common_pb2.FINISH_TYPE_LENGTH and finish.length == 12
    last = entries[-1]
    assert last["completion_tokens"] == 12 and last["prompt_tokens"] == len(PROMPT)
    assert all(e["trace"].traceparent == TRACEPARENT for e in entries)
    assert not tok.errors(rid)


def test_non_streaming_request_emits_once(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    rid = "gen-nostream"
    tok.generate(rid, PROMPT, sampling_params=greedy(6), stream=False)
    detok.wait_finish(rid)
    entries = detok.entries(rid)
    assert len(entries) == 1 and entries[0]["seeded"] and entries[0]["offset"] == 0
    assert len(entries[0]["ids"]) == 6


def test_logprobs_travel_as_logprob_deltas(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    rid = "gen-logprobs"
    tok.generate(
        rid,
        PROMPT,
        sampling_params=greedy(4),
        stream=True,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    detok.wait_finish(rid)
    entries = detok.entries(rid)
    first = entries[0]["logprobs"]
    assert [t.token_id for t in first.input_token_logprobs] == PROMPT
    assert first.input_token_logprobs[0].has_logprob is False  # the first prompt token has none
    assert all(t.has_logprob for t in first.input_token_logprobs[1:])
    assert entries[0]["seed"].want_logprob_text
    out = [t for e in entries for t in e["logprobs"].output_token_logprobs]
    ids = [i for e in entries for i in e["ids"]]
    assert [t.token_id for t in out] == ids and all(t.has_logprob and t.logprob <= 0 for t in out)
    tops = [row for e in entries for row in e["logprobs"].output_top_logprobs]
    assert len(tops) == 4 and all(len(row.entries) == 2 for row in tops)
    assert not any(e["logprobs"].input_token_logprobs for e in entries[1:])  # sent once


def test_bad_request_abort_travels_the_ring(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    tok.generate("bad-temp", PROMPT, sampling_params=common_pb2.SamplingParams(temperature=-1.0))
    tok.generate("bad-ids", [49152 + 7], sampling_params=greedy(2))
    tok.generate("bad-regex", PROMPT, sampling_params=common_pb2.SamplingParams(regex="(a"))  # unbalanced
    for rid, field in (("bad-temp", "temperature"), ("bad-ids", "input_ids"), ("bad-regex", "regex")):
        f = detok.wait_finish(rid)
        assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 400
        assert field in f.message
        assert detok.entries(rid)[0]["seeded"]
        assert not tok.errors(rid)  # rejections travel around the ring, not on Connect


def test_duplicate_live_rid_is_rejected_on_connect(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    tok.generate("dup", PROMPT, sampling_params=greedy(300), stream=True)
    wait_until(lambda: detok.entries("dup"), 10, "the first output of dup")
    tok.generate("dup", PROMPT, sampling_params=greedy(2))
    err = tok.wait_output(lambda o: o.WhichOneof("msg") == "error" and o.error.rid == "dup").error
    assert err.reason.type == common_pb2.FINISH_TYPE_ABORT and err.reason.status_code == 400
    assert "duplicate" in err.reason.message
    tok.send(abort=scheduler_pb2.AbortReq(rid="dup"))
    f = detok.wait_finish("dup")
    assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 499


def test_closing_connect_aborts_origin_requests_and_frees_kv(
    service: ServiceThread, detok: RecordingDetokenizer
) -> None:
    a = TokenizerStream(service.address, "tok-going-away")
    b = TokenizerStream(service.address, "tok-staying")
    try:
        b.generate("b-short", PROMPT, sampling_params=greedy(4))
        for i in range(3):
            a.generate(f"a-long-{i}", PROMPT + [i], sampling_params=greedy(1500), stream=True)
        wait_until(lambda: all(detok.entries(f"a-long-{i}") for i in range(3)), 15, "outputs of a's requests")
        a.cancel()  # the tokenizer goes away
        for i in range(3):
            f = detok.wait_finish(f"a-long-{i}", timeout=15)
            assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 499
            assert "tok-going-away" in f.message
        assert detok.wait_finish("b-short").type == common_pb2.FINISH_TYPE_LENGTH
        load = wait_idle(b, timeout=2.0)
        assert load.num_used_tokens == 0 and load.num_running_reqs == 0
    finally:
        b.cancel()


# ---- sessions ---------------------------------------------------------------------------------
def test_sessions_two_turns_close_and_unknown(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    opened = tok.call(1, open_session=scheduler_pb2.OpenSessionReq(session_id="sess-1", capacity_of_str_len=0))
    assert opened.WhichOneof("msg") == "open_session"
    assert opened.open_session.success and opened.open_session.session_id == "sess-1"
    again = tok.call(2, open_session=scheduler_pb2.OpenSessionReq(session_id="sess-1"))
    assert not again.open_session.success and "already exists" in again.open_session.message
    generated = tok.call(3, open_session=scheduler_pb2.OpenSessionReq())
    assert generated.open_session.success and generated.open_session.session_id

    tok.generate("turn-1", PROMPT, sampling_params=greedy(5), session_id="sess-1")
    detok.wait_finish("turn-1")
    t1 = detok.entries("turn-1")
    t1_out = [i for e in t1 for i in e["ids"]]
    new = [28, 1041, 42]
    tok.generate("turn-2", new, sampling_params=greedy(3), session_id="sess-1")
    assert detok.wait_finish("turn-2").type == common_pb2.FINISH_TYPE_LENGTH
    t2 = detok.entries("turn-2")
    assert t2[-1]["prompt_tokens"] == len(PROMPT) + len(t1_out) + len(new)
    assert t2[-1]["cached_tokens"] >= len(PROMPT)  # the session's prefix came from the radix cache
    assert list(t2[0]["seed"].prompt_tail_ids) == (PROMPT + t1_out + new)[-5:]
    # A turn may name the turn it continues.
    tok.generate("turn-3", new, sampling_params=greedy(2), session_id="sess-1", session_rid="turn-1")
    detok.wait_finish("turn-3")
    assert detok.entries("turn-3")[-1]["prompt_tokens"] == len(PROMPT) + len(t1_out) + len(new)
    tok.generate("turn-bad-rid", new, sampling_params=greedy(2), session_id="sess-1", session_rid="nope")
    f = detok.wait_finish("turn-bad-rid")
    assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 400 and "Invalid request session id" in f.message

    closed = tok.call(4, close_session=scheduler_pb2.CloseSessionReq(session_id="sess-1"))
    assert closed.WhichOneof("msg") == "ack" and closed.ack is True
    tok.generate("after-close", new, sampling_params=greedy(2), session_id="sess-1")
    f = detok.wait_finish("after-close")
    assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 404 and "sess-1" in f.message
    tok.generate("unknown-session", new, sampling_params=greedy(2), session_id="no-such-session")
    f = detok.wait_finish("unknown-session")
    assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 404


def test_session_turn_must_follow_a_finished_turn(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    assert tok.call(1, open_session=scheduler_pb2.OpenSessionReq(session_id="sess-busy")).open_session.success
    tok.generate("busy-1", PROMPT, sampling_params=greedy(1000), stream=True, session_id="sess-busy")
    wait_until(lambda: detok.entries("busy-1"), 10, "busy-1 to run")
    tok.generate("busy-2", [28], sampling_params=greedy(2), session_id="sess-busy")
    f = detok.wait_finish("busy-2")
    assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 400
    assert "Invalid request session id" in f.message and "not finished" in f.message
    tok.send(abort=scheduler_pb2.AbortReq(rid="busy-1"))
    detok.wait_finish("busy-1")
    assert tok.call(2, close_session=scheduler_pb2.CloseSessionReq(session_id="sess-busy")).ack


# ---- tracing ----------------------------------------------------------------------------------
def test_phase_spans_are_children_of_the_request_trace(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    exporter = capture_spans()
    tok.generate(
        "traced", PROMPT, sampling_params=greedy(5), stream=True, trace=common_pb2.TraceContext(traceparent=TRACEPARENT)
    )
    detok.wait_finish("traced")

    def mine():
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("meshlm.rid") == "traced"]
        return spans if len(spans) >= 3 else None

    spans = {s.name: s for s in wait_until(mine, 5, "three scheduler spans")}
    assert set(spans) == {"scheduler.queue", "scheduler.prefill", "scheduler.decode"}
    for s in spans.values():
        assert format(s.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
        assert format(s.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    q, p, d = spans["scheduler.queue"], spans["scheduler.prefill"], spans["scheduler.decode"]
    assert q.start_time <= q.end_time <= p.end_time <= d.end_time
