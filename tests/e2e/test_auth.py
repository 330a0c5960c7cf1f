"""Authentication on every entrance, through `meshlm launch --api-key-file --internal-token-file`
run as a user would (a subprocess of the CLI): every ring link is on the path, gateway →
tokenizer, tokenizer ⇄ scheduler (Connect), scheduler → detokenizer (Push), tokenizer ←
detokenizer (Subscribe). (The prefill → decode handover carries the token in the pd variant of
tests/deploy/test_local_system.py, which runs the charts with auth from a Secret.)

Shows: no child's command line (/proc/<pid>/cmdline, what `ps` shows anyone) holds a secret; HTTP
is 401 without the key and 200 with it; the public gRPC API is UNAUTHENTICATED without the key
and serves Generate with it; health and reflection stay open; the schedulers and the
detokenizer refuse a caller without the internal token (or with the API key instead), accept it,
and the ring, every link carrying the token, serves requests end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.common import protocol
from meshlm.launch.launcher import free_port
from meshlm.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2_grpc, tokenizer_pb2_grpc
from meshlm.v1 import tokenizer_pb2 as pb

from .conftest import ENGINE_ARGS, http_json

KEY = "e2e-api-key-4f1c"
TOKEN = "e2e-internal-token-9b7d"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@dataclass
class Launched:
    proc: subprocess.Popen[str]
    http_url: str
    grpc_address: str
    children: dict[int, list[str]]  # pid -> argv


def _children_of(pid: int) -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
    return out


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(scope="module")
def launched(smollm_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "api-key").write_text(KEY + "\n")
    (secrets / "token").write_text(TOKEN + "\n")
    port, grpc_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "meshlm.launch.cli",
        "launch",
        "--model-path",
        smollm_path,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--api-key-file",
        str(secrets / "api-key"),
        "--internal-token-file",
        str(secrets / "token"),
        *ENGINE_ARGS,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLM_") or k == "MESHLM_CACHE"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    ready = threading.Event()

    def watch() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("meshlm is serving"):
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert ready.wait(300) and proc.poll() is None, "meshlm launch did not come up"
        children = _children_of(proc.pid)
        assert len(children) == 4, children  # detokenizer, scheduler, tokenizer, gateway
        yield Launched(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", children)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _addresses(launched: Launched, component: str) -> list[str]:
    return [
        f"127.0.0.1:{_flag(argv, '--port')}"
        for argv in launched.children.values()
        if argv[argv.index("-m") + 1] == f"meshlm.{component}"
    ]


def test_no_command_line_holds_a_secret(launched: Launched) -> None:
    for pid, argv in [(launched.proc.pid, launched.proc.args), *launched.children.items()]:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        assert KEY.encode() not in cmdline and TOKEN.encode() not in cmdline, argv
    for pid, argv in launched.children.items():  # they got them by environment instead
        component = argv[argv.index("-m") + 1].removeprefix("meshlm.")
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        prefix = f"MESHLM_{component.upper()}_".encode()
        assert prefix + b"INTERNAL_TOKEN=" + TOKEN.encode() in environ, component
        has_key = prefix + b"API_KEY=" + KEY.encode() in environ
        assert has_key == (component in ("gateway", "tokenizer")), component


def _get(url: str, key: str | None) -> int:
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (loopback)
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_http_needs_the_key_and_the_ring_serves_with_the_token(launched: Launched) -> None:
    assert _get(launched.http_url + "/v1/models", None) == 401
    assert _get(launched.http_url + "/v1/models", TOKEN) == 401  # the ring's token is not an API key
    assert _get(launched.http_url + "/v1/models", KEY) == 200
    assert _get(launched.http_url + "/health", None) == 200
    req = urllib.request.Request(
        launched.http_url + "/generate",
        data=b'{"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 5}}',
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 (loopback)
        assert r.status == 200
        out = json.load(r)
    assert out["meta_info"]["completion_tokens"] == 5 and out["text"].strip(), out
    status, _ = http_json(launched.http_url + "/generate", {"text": "x"})
    assert status == 401


def test_public_grpc_api_needs_the_key(launched: Launched) -> None:
    req = pb.GenerateRequest(
        prompts=[pb.Prompt(text="Once upon a time")],
        stream=True,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=4),
    )
    with grpc.insecure_channel(launched.grpc_address) as ch:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=metadata, timeout=30))
            assert err.value.code() == UNAUTH and "requires the API key" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(pb.TokenizeRequest(prompt=pb.Prompt(text="hi")), metadata=metadata, timeout=30)
            assert err.value.code() == UNAUTH
        replies = list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=120))
        assert replies[-1].finished and replies[-1].meta_info.completion_tokens == 4
        assert "".join(r.text for r in replies).strip()
        # health and reflection stay open, as HTTP /health does
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listing = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in listing for s in r.list_services_response.service}
        assert "meshlm.v1.TokenizerService" in names


def test_internal_links_need_the_token(launched: Launched) -> None:
    schedulers, detoks = _addresses(launched, "scheduler"), _addresses(launched, "detokenizer")
    assert len(schedulers) == 1 and len(detoks) == 1
    with_token = (("authorization", f"Bearer {TOKEN}"),)
    for address in schedulers:
        with grpc.insecure_channel(address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            for metadata in ((), (("authorization", f"Bearer {KEY}"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=metadata, timeout=30)
                assert err.value.code() == UNAUTH and "requires the internal token" in err.value.details()
            info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=with_token, timeout=30)
            assert info.vocab_size > 0
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    hello = detokenizer_pb2.DetokenizerInput(hello=protocol.hello("test-auth-probe"))
    with grpc.insecure_channel(detoks[0]) as ch:
        push = detokenizer_pb2_grpc.DetokenizerServiceStub(ch).Push
        with pytest.raises(grpc.RpcError) as err:
            push(iter([hello]), timeout=30)
        assert err.value.code() == UNAUTH
        subscribe = detokenizer_pb2_grpc.DetokenizerServiceStub(ch).Subscribe
        with pytest.raises(grpc.RpcError) as err:
            list(subscribe(detokenizer_pb2.SubscribeRequest(hello=protocol.hello("x")), timeout=30))
        assert err.value.code() == UNAUTH
        assert push(iter([hello]), metadata=with_token, timeout=30).messages == 1
