"""API keys, /v1/models without a tokenizer, OpenAPI, metrics, config, and the no-torch rule."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_testlib import MODEL, UNREACHABLE, make_config
from tests.spans import capture_spans

from meshlm.common.auth import AuthConfig
from meshlm.gateway.app import create_app
from meshlm.gateway.config import GatewayConfig

KEY = "s3cret"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def keyed_client():
    with TestClient(create_app(make_config(auth=AuthConfig(api_key=KEY)))) as client:
        yield client


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
)
def test_api_key_missing_or_wrong_is_401(keyed_client, headers):
    for path in ("/v1/models", "/get_model_info", "/openapi.json"):
        response = keyed_client.get(path, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["message"] and error["type"] == "authentication_error"
    response = keyed_client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert response.status_code == 401


def test_api_key_accepted(keyed_client):
    response = keyed_client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == MODEL
    # validation still runs behind the key
    bad = keyed_client.post("/v1/completions", json={"prompt": ""}, headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400


def test_api_key_exemptions(keyed_client):
    assert keyed_client.get("/metrics").status_code == 200
    assert keyed_client.get("/health").status_code == 503  # no tokenizer, but not 401
    assert keyed_client.get("/health_generate").status_code == 503
    preflight = keyed_client.options(
        "/v1/models", headers={"Origin": "http://a.b", "Access-Control-Request-Method": "GET"}
    )
    assert preflight.status_code == 200


def test_openai_client_reads_401(keyed_client):
    client = openai.OpenAI(api_key="wrong", base_url="http://testserver/v1", http_client=keyed_client, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.models.list()
    assert "Unauthorized" in info.value.message


def test_one_http_span_per_request_and_none_from_fastapi(offline_client):
    """The telemetry middleware's `http <route>` span is the request's only span: FastAPI's own
    instrumentation (on by default from FastAPI 0.165 under an SDK tracer provider) stays off."""
    exporter = capture_spans()
    assert offline_client.get("/v1/models", headers={"traceparent": TRACEPARENT}).status_code == 200
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["http /v1/models"]
    assert format(spans[0].context.trace_id, "032x") == TRACEPARENT.split("-")[1]


def test_models_without_tokenizer(offline_client):
    listing = offline_client.get("/v1/models").json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [MODEL]
    assert listing["data"][0]["object"] == "model"
    assert offline_client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


@pytest.mark.parametrize("model", ["gpt-4", "org/other-model"])
def test_unknown_model_is_404(offline_client, model):
    response = offline_client.get(f"/v1/models/{model}")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and model in error["message"]
    for path, body in (
        ("/v1/completions", {"model": model, "prompt": "hi"}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"model": model, "input": "hi"}),
    ):
        response = offline_client.post(path, json=body)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "model_not_found"


def test_openai_client_reads_404(offline_client):
    client = openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=offline_client, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert "nope" in info.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert "max_tokens" in bad.value.message


def test_openapi_served(offline_client):
    doc = offline_client.get("/openapi.json")
    assert doc.status_code == 200
    paths = doc.json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/models/{model_id}",
        "/generate",
        "/encode",
        "/health",
        "/health_generate",
        "/get_model_info",
        "/get_server_info",
        "/flush_cache",
        "/abort_request",
        "/open_session",
        "/close_session",
        "/metrics",
    ):
        assert path in paths, path
    docs = offline_client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_metrics(offline_client):
    offline_client.get("/v1/models")
    offline_client.post("/v1/completions", json={"prompt": ""})
    offline_client.get("/v1/models/abc")
    text = offline_client.get("/metrics").text
    assert 'meshlm:http_requests_total{route="/v1/models",status="200"} 1.0' in text
    assert 'meshlm:http_requests_total{route="/v1/completions",status="400"} 1.0' in text
    assert 'meshlm:http_requests_total{route="/v1/models/{model_id:path}",status="404"} 1.0' in text
    assert 'meshlm:http_request_duration_seconds_count{route="/v1/models"} 1.0' in text


def test_config_flags_env_and_defaults():
    def parser(env):
        p = argparse.ArgumentParser()
        GatewayConfig.add_cli_args(p, environ=env)
        return p

    default = GatewayConfig.from_cli_args(parser({}).parse_args([]))
    assert default == GatewayConfig()
    env = {
        "MESHLM_GATEWAY_PORT": "8001",
        "MESHLM_GATEWAY_TOKENIZER_ADDRS": "a:1,b:2",
        "MESHLM_GATEWAY_API_KEY": "k",
        "MESHLM_GATEWAY_GRACE_PERIOD_S": "2.5",
    }
    from_env = GatewayConfig.from_cli_args(parser(env).parse_args([]))
    assert (from_env.port, from_env.tokenizer_addrs, from_env.auth.api_key_value, from_env.grace_period_s) == (
        8001,
        ("a:1", "b:2"),
        "k",
        2.5,
    )
    assert GatewayConfig.from_env(env) == from_env
    help_text = parser({"MESHLM_GATEWAY_API_KEY": "s3cr3t"}).format_help()
    assert "MESHLM_GATEWAY_API_KEY" in help_text and "s3cr3t" not in help_text  # --help keeps secrets
    flags = GatewayConfig.from_cli_args(
        parser(env).parse_args(
            [
                "--port",
                "9000",
                "--tokenizer-addrs",
                "c:3",
                "--served-model-name",
                "m",
                "--request-timeout-s",
                "5",
                "--log-format",
                "json",
            ]
        )
    )
    assert (flags.port, flags.tokenizer_addrs, flags.served_model_name, flags.request_timeout_s, flags.log_format) == (
        9000,
        ("c:3",),
        "m",
        5.0,
        "json",
    )
    assert flags.auth.api_key_value == "k"  # env still fills what flags leave out
    with pytest.raises(SystemExit):
        parser({}).parse_args(["--tokenizer-addrs", "no-port"])
    with pytest.raises(ValueError):
        GatewayConfig(tokenizer_addrs=())
    with pytest.raises(dataclasses.FrozenInstanceError):
        GatewayConfig().port = 1  # type: ignore[misc]


def test_no_torch_no_transformers():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "import meshlm.gateway.app, meshlm.gateway.__main__\n"
        "from meshlm.gateway.config import GatewayConfig\n"
        f"meshlm.gateway.app.create_app(GatewayConfig(tokenizer_addrs=('{UNREACHABLE}',)))\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'numpy') if sys.modules.get(m) is not None]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_server_speaks_http_through_httptools() -> None:
    """The gateway's uvicorn parses and writes HTTP/1.1 with httptools (C), not h11 (pure Python):
    every streamed token is one HTTP write, and h11 cost ~10% more gateway CPU per token."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from meshlm.gateway.__main__ import uvicorn_config

    cfg = uvicorn_config(create_app(make_config()), make_config())
    cfg.load()
    assert cfg.http_protocol_class is HttpToolsProtocol


def test_the_server_runs_on_uvloop() -> None:
    """uvicorn runs the gateway on the loop of the other services (common/event_loop.py): uvloop,
    a dependency, whose loop costs less CPU per streamed token than the standard library's."""
    import uvloop

    from meshlm.gateway.__main__ import uvicorn_config

    cfg = uvicorn_config(create_app(make_config()), make_config())
    assert cfg.loop == "uvloop"
    assert cfg.get_loop_factory() is uvloop.new_event_loop
