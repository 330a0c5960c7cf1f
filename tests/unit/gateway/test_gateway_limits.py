"""The gateway's edge (issue 12): every number fits its proto field and every list its limit before
any gRPC call (the app's only tokenizer is unreachable, so a request that got through would be a
503), strict JSON (no NaN, no lone surrogates), a body limit (413), and an OpenAPI document that
states the bounds (meshlm.common.input_limits / sampling_rules) and the served model name."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from gateway_testlib import make_config
from test_gateway_validation import assert_400

from meshlm.common.input_limits import INT32_MAX, MAX_LOGIT_BIAS, MAX_N, MAX_PROMPTS, MAX_STOP, MAX_TOP_LOGPROBS_NUM
from meshlm.gateway.app import create_app

BIG = 1 << 40
CHAT = [{"role": "user", "content": "hi"}]

# The four operations schemathesis found answering 500 "Value out of range", and their kin.
OUT_OF_RANGE = [
    ("/encode", {"input_ids": [1, BIG]}, "input_ids"),
    ("/encode", {"input_ids": [[1], [-5]]}, "input_ids"),
    ("/open_session", {"capacity_of_str_len": 999999999999999999}, "capacity_of_str_len"),
    ("/v1/detokenize", {"tokens": [1561026161977]}, "tokens"),
    ("/v1/embeddings", {"input": [1, 25681445024]}, "input"),
    ("/v1/completions", {"prompt": [-179, 14764116402176165888]}, "prompt"),
    ("/generate", {"input_ids": [1, 2], "token_ids_logprob": [BIG]}, "token_ids_logprob"),
    ("/generate", {"text": "x", "top_logprobs_num": BIG}, "top_logprobs_num"),
    ("/generate", {"text": "x", "top_logprobs_num": MAX_TOP_LOGPROBS_NUM + 1}, "top_logprobs_num"),
    ("/generate", {"text": "x", "logprob_start_len": BIG}, "logprob_start_len"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": INT32_MAX + 1}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"stream_interval": BIG}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"sampling_seed": 1 << 64}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": 1e300}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"99999999999": 1.0}}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [BIG]}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"n": MAX_N + 1}}, "sampling_params"),
    ("/v1/completions", {"prompt": "x", "seed": 1 << 63}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": BIG}, "top_k"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"4294967296": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": BIG}, "min_tokens"),
]


@pytest.mark.parametrize("path,body,param", OUT_OF_RANGE)
def test_out_of_range_integers_are_400_naming_the_field(offline_client, path, body, param):
    error = assert_400(offline_client.post(path, json=body), param)
    assert param in error["message"]


SIZES = [
    ("/generate", {"text": ["x"] * (MAX_PROMPTS + 1)}, "text"),
    ("/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": MAX_N + 1}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * (MAX_STOP + 1)}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "rid": "r" * 257}, "rid"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/generate", {"text": "x", "rid": ["a"] * 3}, "rid"),  # a list of rids needs a batch
    ("/close_session", {"session_id": ""}, "session_id"),
]


@pytest.mark.parametrize("path,body,param", SIZES)
def test_size_limits_are_400_naming_the_field(offline_client, path, body, param):
    assert_400(offline_client.post(path, json=body), param)


@pytest.mark.parametrize(
    "raw,where",
    [
        (b'{"prompt": "\\udb3c", "max_tokens": 2}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (b'{"prompt": "x", "logit_bias": {"\\udfff": 1}}', "logit_bias"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(offline_client, raw, where):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = offline_client.post(path, content=raw, headers={"content-type": "application/json"})
    error = assert_400(response, where.split("[")[0])
    assert error["message"].startswith(where) and "surrogate" in error["message"]


def test_a_valid_surrogate_pair_is_one_character(offline_client):
    raw = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    response = offline_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 503, response.text  # valid: it got as far as the (absent) tokenizer


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b'{"prompt": "x", "temperature": NaN}', "NaN"),
        (b'{"prompt": "x", "temperature": Infinity}', "Infinity"),
        (b'{"prompt": "\xff\xfe"}', "Invalid JSON body"),
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "Invalid JSON body"),
        (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ],
)
def test_non_json_numbers_and_bytes_are_400(offline_client, raw, needle):
    response = offline_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert needle in assert_400(response)["message"]


def test_body_over_the_limit_is_413():
    with TestClient(create_app(make_config(max_request_bytes=1000))) as client:
        response = client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert response.status_code == 413, response.text
        assert "--max-request-bytes" in response.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit applies to the bytes as they arrive
            yield b'{"prompt": "'
            yield b"x" * 2000
            yield b'"}'

        response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text
        assert client.post("/v1/completions", json={"prompt": "x", "n": 0}).status_code == 400  # small: as before


def test_openapi_states_the_limits_and_the_served_model():
    with TestClient(create_app(make_config(served_model_name="m1"))) as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["model"]["anyOf"][0]["enum"] == ["m1"]
    assert completion["n"]["maximum"] == MAX_N and completion["n"]["minimum"] == 1
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == INT32_MAX
    assert completion["top_k"]["not"] == {"enum": [0]}
    texts = completion["prompt"]["anyOf"][1]
    assert texts["maxItems"] == MAX_PROMPTS and texts["items"]["minLength"] == 1
    bias = completion["logit_bias"]["anyOf"][0]
    assert bias["maxProperties"] == MAX_LOGIT_BIAS and bias["additionalProperties"] is False
    native = schemas["NativeSamplingParams"]["properties"]
    assert native["temperature"]["anyOf"][0]["maximum"] == pytest.approx(3.4028234663852886e38)
    assert schemas["OpenSessionReq"]["properties"]["capacity_of_str_len"]["maximum"] == INT32_MAX


def test_openapi_states_the_vocabulary_once_known(client):
    before = client.get("/openapi.json").json()["components"]["schemas"]
    assert before["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == INT32_MAX
    assert client.get("/v1/models").status_code == 200  # the gateway learns the model info
    after = client.get("/openapi.json").json()["components"]["schemas"]
    assert after["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 999  # vocab_size 1000
    assert after["EmbeddingRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["test-model"]
