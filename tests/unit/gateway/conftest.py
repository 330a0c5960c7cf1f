"""Gateway fixtures: apps against an unreachable tokenizer (validation happens before any gRPC call)
and apps in front of a fake TokenizerService (gateway_testlib.FakeTokenizer)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from gateway_testlib import FakeTokenizerServer, make_config

from meshlm.gateway.app import create_app


@pytest.fixture
def offline_client():
    """An app whose only tokenizer is unreachable: everything before the first gRPC call works."""
    with TestClient(create_app(make_config())) as client:
        yield client


@pytest.fixture(scope="module")
def fake_tokenizer():
    with FakeTokenizerServer() as server:
        yield server


@pytest.fixture
def client(fake_tokenizer):
    """An app in front of the fake tokenizer (served model name from GetModelInfo)."""
    fake_tokenizer.servicer.__init__()  # fresh behaviour and records per test
    config = make_config(tokenizer_addrs=(fake_tokenizer.address,), served_model_name=None)
    with TestClient(create_app(config)) as c:
        yield c
