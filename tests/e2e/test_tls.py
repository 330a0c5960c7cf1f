"""The ring under mutual TLS: a throwaway CA signs one certificate (localhost / 127.0.0.1) that
all four processes use as server and client; a request completes through the gateway, the
tokenizer's public API refuses a plaintext client and a client of another CA, and its plaintext
--health-port answers grpc.health.v1 (and nothing else)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.tls import sync_channel
from meshlm.launch.launcher import System, free_port
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.tls_certs import Pki, make_pki

from .conftest import http_json, start_system


class Ring:
    def __init__(self, system: System, pki: Pki, health_port: int) -> None:
        self.system, self.pki, self.health_port = system, pki, health_port


@pytest.fixture(scope="module")
def ring(smollm_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ring]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    health_port = free_port()
    system = start_system(smollm_path, tls=pki.tls(), tokenizer_args=("--health-port", str(health_port)))
    yield Ring(system, pki, health_port)
    system.stop()


def _tokenize(channel: grpc.Channel) -> tokenizer_pb2.TokenizeResponse:
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
    req = tokenizer_pb2.TokenizeRequest(prompt=tokenizer_pb2.Prompt(text="Hello there"))
    return stub.Tokenize(req, timeout=10)


def test_every_link_under_mtls_completes_a_request(ring: Ring) -> None:
    for child in ring.system.children:
        argv = child.argv
        assert argv[argv.index("--tls-ca-file") + 1] == str(ring.pki.ca_file), child.name
    body = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 6},
    }
    status, out = http_json(ring.system.http_url + "/generate", body, timeout=60)
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == 6 and out["text"].strip(), out
    # the public gRPC API, as a client holding a certificate of the system's CA
    with sync_channel(ring.system.grpc_address, ring.pki.tls()) as ch:
        assert _tokenize(ch).count > 0
        req = tokenizer_pb2.GenerateRequest(
            prompts=[tokenizer_pb2.Prompt(text="Once upon a time")],
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=4),
        )
        replies = list(tokenizer_pb2_grpc.TokenizerServiceStub(ch).Generate(req, timeout=60))
        assert replies[-1].finished and replies[-1].meta_info.completion_tokens == 4


def test_plaintext_client_is_rejected(ring: Ring) -> None:
    with grpc.insecure_channel(ring.system.grpc_address) as ch, pytest.raises(grpc.RpcError) as err:
        _tokenize(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_of_another_ca_is_rejected(ring: Ring, tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other")
    # it trusts our CA (so the server's certificate checks out) but presents its own CA's cert
    impostor = grpc.ssl_channel_credentials(
        root_certificates=ring.pki.ca_file.read_bytes(),
        private_key=other.key_file.read_bytes(),
        certificate_chain=other.cert_file.read_bytes(),
    )
    with grpc.secure_channel(ring.system.grpc_address, impostor) as ch, pytest.raises(grpc.RpcError) as err:
        _tokenize(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(root_certificates=ring.pki.ca_file.read_bytes())
    with grpc.secure_channel(ring.system.grpc_address, no_cert) as ch, pytest.raises(grpc.RpcError) as err:
        _tokenize(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_health_port_serves_health_only(ring: Ring) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{ring.health_port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            _tokenize(ch)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
