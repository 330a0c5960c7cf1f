"""The gateway's SGLang worker surface in front of a fake TokenizerService: /model_info and
/server_info (and their /get_* names), /v1/loads (SGLang's shape, include sections, dp_rank,
prometheus text) and /get_load, all built from GetLoads / GetServerInfo."""

from __future__ import annotations

import pytest
from gateway_testlib import MODEL, last_request


def test_info_routes_have_sglang_names_and_keys(client):
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"] == "/models/test" and info["served_model_name"] == MODEL
        assert info["is_generation"] is True and isinstance(info["architectures"], list)
    for path in ("/server_info", "/get_server_info"):
        server = client.get(path).json()
        assert server["dp_size"] == 1 and server["version"] == "0.1.0" and server["is_embedding"] is False
        assert server["max_total_tokens"] == 4096 and server["internal_states"] == server["schedulers"]
        assert "model" not in server  # smg reads `model` as the model id string


def test_v1_loads_reports_each_scheduler_that_reported(client):
    body = client.get("/v1/loads").json()
    assert body["version"] == "0.1.0" and body["dp_rank_count"] == 2 and body["timestamp"]
    [load] = body["loads"]  # scheduler 1 has not reported yet
    assert load["dp_rank"] == 0 and load["scheduler_id"] == "s0" and load["report_age_s"] == 0.25
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_total_reqs"]) == (1, 2, 3)
    assert (load["num_used_tokens"], load["max_total_num_tokens"], load["max_running_requests"]) == (30, 4096, 8)
    assert load["token_usage"] == pytest.approx(30 / 4096) and load["queues"] == {"waiting": 2}


def test_v1_loads_include_dp_rank_and_format(client, fake_tokenizer):
    [core] = client.get("/v1/loads?include=core").json()["loads"]
    assert "queues" not in core and core["num_running_reqs"] == 1
    [queues] = client.get("/v1/loads?include=queues").json()["loads"]
    assert set(queues) == {"dp_rank", "timestamp", "queues"}
    assert client.get("/v1/loads?include=core,disagg,queues,memory").status_code == 200  # what smg asks
    bad = client.get("/v1/loads?include=core,bogus")
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
    assert client.get("/v1/loads?dp_rank=0").json()["loads"][0]["dp_rank"] == 0
    assert last_request(fake_tokenizer).dp_rank == 0
    assert client.get("/v1/loads?dp_rank=1").json()["loads"] == []
    assert client.get("/v1/loads?dp_rank=5").status_code == 400
    assert client.get("/v1/loads?dp_rank=-1").status_code == 400
    assert client.get(f"/v1/loads?dp_rank={1 << 40}").status_code == 400  # never reaches protobuf
    text = client.get("/v1/loads?format=prometheus")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert 'sglang_num_running_reqs{dp_rank="0"} 1' in text.text
    assert 'sglang_queues_waiting{dp_rank="0"} 2' in text.text
    assert client.get("/v1/loads?format=xml").status_code == 400


def test_get_load_is_sglangs_older_shape(client):
    assert client.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 30}]
