"""The gateway's SGLang-native routes in front of a fake TokenizerService: /generate (single, batch,
per-prompt sampling, cumulative stream, n), /encode, info, health and control routes, trace
context, finish types."""

from __future__ import annotations

from gateway_testlib import MODEL, last_request, sse_events

from meshlm.v1 import common_pb2


def test_generate_single(client, fake_tokenizer):
    out = client.post(
        "/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "rid": "r1"}
    ).json()
    assert out["text"] == " w0 w1" and out["output_ids"] == [100, 101]
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (2, 2, 1)
    assert "index" not in out
    stop = client.post("/generate", json={"text": "STOP", "sampling_params": {"max_new_tokens": 5}}).json()
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    req = last_request(fake_tokenizer)
    assert req.sampling_params.max_new_tokens == 5 and not req.stream


def test_generate_batch_and_logprobs(client, fake_tokenizer):
    out = client.post(
        "/generate",
        json={
            "input_ids": [[1, 2], [3]],
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 1,
            "return_text_in_logprobs": True,
        },
    ).json()
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1]
    meta = out[0]["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 0, "1"], [-1.0, 1, " 2"]]
    assert meta["output_token_logprobs"] == [[-0.5, 100, " w0"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 100, " w0"]]]
    assert meta["input_top_logprobs"] == [None, None]
    req = last_request(fake_tokenizer)
    assert req.logprob_start_len == 0 and req.top_logprobs_num == 1 and len(req.prompts) == 2


def test_generate_per_prompt_sampling_params(client, fake_tokenizer):
    out = client.post(
        "/generate",
        json={"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}]},
    ).json()
    assert [o["text"] for o in out] == [" w0", " w0 w1 w2"]
    assert [o["meta_info"]["id"] for o in out] == ["x", "y"]
    rids = sorted(r.rid for r in fake_tokenizer.servicer.requests)
    assert rids == ["x", "y"]


def test_generate_stream_is_cumulative(client):
    response = client.post("/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    events = sse_events(response)
    assert [e["text"] for e in events] == [" w0", " w0 w1", " w0 w1 w2"]
    assert [e["output_ids"] for e in events][-1] == [100, 101, 102]
    assert [e["meta_info"]["finish_reason"] for e in events][-1] == {"type": "length", "length": 3}
    assert events[0]["meta_info"]["finish_reason"] is None


def test_generate_n(client):
    out = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1, "n": 3}}).json()
    assert [o["index"] for o in out] == [0, 1, 2]


def test_encode(client):
    assert client.post("/encode", json={"text": "a b"}).json()["embedding"] == [0.5, -0.25, 0.0]
    batch = client.post("/encode", json={"input_ids": [[1], [2, 3]], "rid": "e"}).json()
    assert [b["meta_info"] for b in batch] == [{"id": "e_0", "prompt_tokens": 1}, {"id": "e_1", "prompt_tokens": 2}]


def test_info_routes(client):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == "/models/test" and info["served_model_name"] == MODEL
    assert info["is_generation"] is True and info["eos_token_ids"] == [2]
    server = client.get("/get_server_info").json()
    assert server["schedulers"] == [
        {
            "scheduler_id": "s0",
            "num_running_reqs": 1,
            "num_queue_reqs": 2,
            "num_used_tokens": 30,
            "max_total_num_tokens": 4096,
            "token_usage": 0.0,
            "cache_hit_rate": 0.0,
            "max_running_requests": 0,
        }
    ]
    assert server["context_length"] == 2048 and server["tokenizer_config"] == {"routing": "round_robin"}
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["root"] == "/models/test" and card["max_model_len"] == 2048
    tokens = client.post("/v1/tokenize", json={"prompt": "a b c"}).json()
    assert tokens == {"tokens": [0, 1, 2], "count": 3, "max_model_len": 2048}
    assert client.post("/v1/detokenize", json={"tokens": [1, 2]}).json() == {"text": "t1 t2"}


def test_health(client, fake_tokenizer):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    req = last_request(fake_tokenizer)
    assert req.rid.startswith("HEALTH_CHECK_") and req.sampling_params.max_new_tokens == 1
    fake_tokenizer.set_serving(False)
    try:
        assert client.get("/health").status_code == 503
    finally:
        fake_tokenizer.set_serving(True)


def test_control_routes(client, fake_tokenizer):
    assert client.post("/flush_cache").status_code == 200
    fake_tokenizer.servicer.flush_ok = False
    response = client.get("/flush_cache")
    assert response.status_code == 400 and "running" in response.json()["error"]["message"]
    assert client.post("/abort_request", json={"rid": "abc"}).status_code == 200
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert [(a.rid, a.abort_all) for a in fake_tokenizer.servicer.aborts] == [("abc", False), ("", True)]
    assert client.post("/abort_request", json={}).status_code == 400
    assert client.post("/open_session", json={"capacity_of_str_len": 100, "session_id": "s1"}).json() == "s1"
    assert len(client.post("/open_session", json={"capacity_of_str_len": 100}).json()) == 32  # chosen here
    assert client.post("/close_session", json={"session_id": "s1"}).status_code == 200
    missing = client.post("/close_session", json={"session_id": "nope"})
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
    client.post(
        "/generate",
        json={"text": "a", "session_params": {"id": "s1", "rid": "r0"}, "sampling_params": {"max_new_tokens": 1}},
    )
    req = last_request(fake_tokenizer)
    assert (req.session_id, req.session_rid) == ("s1", "r0")


def test_incoming_traceparent_is_the_parent(client, fake_tokenizer):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    client.post(
        "/v1/completions",
        json={"prompt": "a", "max_tokens": 1},
        headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
    )
    sent = last_request(fake_tokenizer).trace.traceparent
    assert sent.split("-")[1] == trace_id and sent.split("-")[2] != "b7ad6b7169203331"
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})  # no header: a new trace
    fresh = last_request(fake_tokenizer).trace.traceparent
    assert fresh.startswith("00-") and fresh.split("-")[1] != trace_id


def test_finish_type_mapping():
    from meshlm.gateway.outputs import Output
    from meshlm.v1 import tokenizer_pb2

    out = Output(0)
    out.add(
        tokenizer_pb2.GenerateResponse(
            finished=True,
            meta_info=tokenizer_pb2.MetaInfo(
                finish_reason=common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_STOP, matched_token=2)
            ),
        )
    )
    assert out.openai_finish_reason() == "stop" and out.matched_stop() == 2
    assert out.sglang_finish_reason() == {"type": "stop", "matched": 2}
