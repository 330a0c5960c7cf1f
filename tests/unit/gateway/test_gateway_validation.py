"""Bad input is a 400 in OpenAI's error shape (never 422), decided before any gRPC call: the app's
only tokenizer is unreachable, so a request that got past validation would be a 503."""

from __future__ import annotations

import pytest


def assert_400(response, param="__any__"):
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400
    assert isinstance(error["message"], str) and error["message"]
    if param != "__any__":
        assert error["param"] == param, error
    return error


COMPLETION_CASES = [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "top_k": 0}, "top_k"),
    ({"prompt": "hi", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"max_tokens": 5}, "prompt"),
]


@pytest.mark.parametrize("body,param", COMPLETION_CASES)
def test_completions_bad_input(offline_client, body, param):
    error = assert_400(offline_client.post("/v1/completions", json=body), param)
    assert param in error["message"]  # the message names the field


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.01}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": "true"}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),  # needs logprobs
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.parametrize("body,param", CHAT_CASES)
def test_chat_bad_input(offline_client, body, param):
    assert_400(offline_client.post("/v1/chat/completions", json=body), param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/generate"])
def test_invalid_json_is_400(offline_client, path):
    response = offline_client.post(path, content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    error = assert_400(response, None)
    assert "JSON" in error["message"]


@pytest.mark.parametrize(
    "content,content_type",
    [
        (b"[1, 2]", "application/json"),  # not an object
        (b"", "application/json"),  # no body
        (b"prompt=hi", "application/x-www-form-urlencoded"),  # not JSON
    ],
)
def test_body_not_a_json_object_is_400(offline_client, content, content_type):
    response = offline_client.post("/v1/completions", content=content, headers={"content-type": content_type})
    assert_400(response)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": ""}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ],
)
def test_embeddings_bad_input(offline_client, body, param):
    assert_400(offline_client.post("/v1/embeddings", json=body), param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params"),
        ({"text": "a", "sampling_params": {"no_such_param": 1}}, "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "rid": ["x", "y"]}, "rid"),
        ({"text": "a", "image_data": "http://x/y.png"}, "image_data"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ],
)
def test_generate_bad_input(offline_client, body, param):
    assert_400(offline_client.post("/generate", json=body), param)


def test_error_messages_name_the_limit(offline_client):
    error = assert_400(offline_client.post("/v1/completions", json={"prompt": "x", "temperature": 3}), "temperature")
    assert "2" in error["message"] and "3" in error["message"]


def test_valid_request_reaches_grpc(offline_client):
    """Control: a valid request passes validation and fails on the (unreachable) tokenizer: 503."""
    response = offline_client.post("/v1/completions", json={"model": "test-model", "prompt": "hi"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == 503


def test_unknown_route_and_method(offline_client):
    response = offline_client.get("/v1/nope")
    assert response.status_code == 404 and "error" in response.json()
    response = offline_client.get("/v1/completions")
    assert response.status_code == 405 and "error" in response.json()
