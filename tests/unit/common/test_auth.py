"""meshlm.common.auth and auth_interceptors, in process: secrets from a value, a file or the
environment (never shown), and a GrpcServer that refuses calls without the right bearer token
(UNAUTHENTICATED, before the handler runs) on every call kind, keeps health and reflection open,
and accepts what a Dialer with the token sends."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.common.auth import AuthConfig
from meshlm.common.channels import Dialer
from meshlm.common.grpc_server import GrpcServer
from meshlm.scheduler.service.config import SchedulerServiceConfig
from meshlm.tokenizer.config import TokenizerConfig

KEY, TOKEN = "k3y-public", "t0ken-internal"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


# ---- secrets ----------------------------------------------------------------------------------
def test_secrets_from_values_files_and_their_checks(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")  # a Kubernetes Secret's file often ends with a newline
    auth = AuthConfig(api_key_file=str(key_file), internal_token=TOKEN)
    assert (auth.api_key_value, auth.internal_token_value, auth.enabled) == (KEY, TOKEN, True)
    assert KEY not in repr(auth) and TOKEN not in repr(auth)
    assert auth.describe() == {"api_key": f"file {key_file}", "internal_token": "set"}
    assert not AuthConfig(api_key="", internal_token_file="").enabled
    with pytest.raises(ValueError, match="--api-key or --api-key-file, not both"):
        AuthConfig(api_key=KEY, api_key_file=str(key_file))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--internal-token-file .*empty is empty"):
        AuthConfig(internal_token_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"--api-key-file .*missing: cannot read it"):
        AuthConfig(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "spaced").write_text("two words")
    with pytest.raises(ValueError, match="printable ASCII without spaces") as err:
        AuthConfig(internal_token_file=str(tmp_path / "spaced"))
    assert "two words" not in str(err.value)


def test_flags_and_environment_of_the_components(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {"MESHLM_TOKENIZER_API_KEY": KEY, "MESHLM_TOKENIZER_INTERNAL_TOKEN_FILE": str(token_file)}
    parser = argparse.ArgumentParser()
    TokenizerConfig.add_cli_args(parser, environ=env)
    assert KEY not in parser.format_help() and "MESHLM_TOKENIZER_API_KEY_FILE" in parser.format_help()
    config = TokenizerConfig.from_cli_args(parser.parse_args([]))
    assert (config.auth.api_key_value, config.auth.internal_token_value) == (KEY, TOKEN)
    assert TokenizerConfig.from_env(env).auth == config.auth
    shown = config.to_json()  # what GetServerInfo returns
    assert KEY not in shown and TOKEN not in shown
    assert json.loads(shown)["auth"] == {"api_key": "set", "internal_token": f"file {token_file}"}
    # the scheduler has no public API: no --api-key, only the internal token
    parser = argparse.ArgumentParser()
    SchedulerServiceConfig.add_cli_args(parser, environ={})
    assert "--api-key" not in parser.format_help()
    sched = SchedulerServiceConfig.from_cli_args(parser.parse_args(["--internal-token-file", str(token_file)]))
    assert sched.auth.internal_token_value == TOKEN and sched.auth.api_key_value is None


# ---- the server interceptor ----------------------------------------------------------------
class Echo:
    """test.Public and test.Internal, each with one method per call kind (bytes in, bytes out)."""

    def __init__(self) -> None:
        self.calls = 0

    async def uu(self, request: bytes, context: Any) -> bytes:
        self.calls += 1
        return request

    async def us(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        self.calls += 1
        yield request
        yield request

    async def su(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        self.calls += 1
        return b"".join([r async for r in requests])

    async def ss(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        self.calls += 1
        async for r in requests:
            yield r

    def register(self, server: grpc.aio.Server) -> None:
        handlers = {
            "uu": grpc.unary_unary_rpc_method_handler(self.uu),
            "us": grpc.unary_stream_rpc_method_handler(self.us),
            "su": grpc.stream_unary_rpc_method_handler(self.su),
            "ss": grpc.stream_stream_rpc_method_handler(self.ss),
        }
        for service in ("test.Public", "test.Internal"):
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


async def _requests(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def call_all(channel: grpc.aio.Channel, service: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[Any]:
    """One call of each kind; returns each one's result or its status code."""
    out: list[Any] = []
    calls = [
        lambda: channel.unary_unary(f"/{service}/uu")(b"a", metadata=metadata, timeout=5),
        lambda: _collect(channel.unary_stream(f"/{service}/us")(b"b", metadata=metadata, timeout=5)),
        lambda: channel.stream_unary(f"/{service}/su")(_requests(b"c", b"d"), metadata=metadata, timeout=5),
        lambda: _write_style(channel.stream_stream(f"/{service}/ss")(metadata=metadata, timeout=5)),
    ]
    for call in calls:
        try:
            out.append(await call())
        except grpc.aio.AioRpcError as e:
            out.append((e.code(), e.details()))
    return out


async def _collect(call: Any) -> list[bytes]:
    return [m async for m in call]


async def _write_style(call: Any) -> list[bytes]:
    """A bidi stream driven by write() / read(), as the scheduler's Push client does."""
    await call.write(b"e")
    await call.done_writing()
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


SERVED = [b"a", [b"b", b"b"], b"cd", [b"e"]]


def test_bearer_tokens_on_every_call_kind_health_and_reflection_open() -> None:
    async def run() -> None:
        echo = Echo()
        auth = AuthConfig(api_key=KEY, internal_token=TOKEN)
        services = ["test.Public", "test.Internal"]
        server = GrpcServer(services, "127.0.0.1", 0, auth=auth, public_services=["test.Public"])
        echo.register(server.server)
        address = f"127.0.0.1:{await server.start()}"
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                for service, wants in (("test.Public", "API key"), ("test.Internal", "internal token")):
                    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
                        for code, details in await call_all(ch, service, metadata):
                            assert code == UNAUTH and f"{service} requires the {wants}" in details
                assert echo.calls == 0  # refused before any handler ran
                # the public API takes the API key or the internal token; internal links the token only
                assert await call_all(ch, "test.Public", (("authorization", f"Bearer {KEY}"),)) == SERVED
                assert await call_all(ch, "test.Public", (("authorization", f"Bearer {TOKEN}"),)) == SERVED
                refused = await call_all(ch, "test.Internal", (("authorization", f"Bearer {KEY}"),))
                assert [r[0] for r in refused] == [UNAUTH] * 4
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                reflection = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    _requests(reflection_pb2.ServerReflectionRequest(list_services="")), timeout=5
                )
                names = {s.name async for r in reflection for s in r.list_services_response.service}
                assert {"test.Public", "test.Internal", "grpc.health.v1.Health"} <= names
            # a Dialer with the token puts it on every call (the ring's clients)
            dialer = Dialer(token=TOKEN)
            async with dialer.channel(address) as ch:
                assert await call_all(ch, "test.Internal") == SERVED
                assert await call_all(ch, "test.Public") == SERVED
            async with Dialer(token="not-it").channel(address) as ch:
                assert [r[0] for r in await call_all(ch, "test.Internal")] == [UNAUTH] * 4
        finally:
            await server.drain(0.1)

    asyncio.run(run())


def test_a_refused_stream_ends_without_racing_the_clients_writes() -> None:
    """A bidi client that writes before it reads always sees the refusal (not gRPC's INTERNAL for a
    write that lost a race with the abort), and a streaming client that never sends anything is
    still refused, after REFUSE_WAIT_S, with the handler never run."""
    from meshlm.common.auth_interceptors import REFUSE_WAIT_S

    async def run() -> None:
        echo = Echo()
        server = GrpcServer(["test.Internal"], "127.0.0.1", 0, auth=AuthConfig(internal_token=TOKEN))
        echo.register(server.server)
        address = f"127.0.0.1:{await server.start()}"
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                for _ in range(100):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await _write_style(ch.stream_stream("/test.Internal/ss")(timeout=5))
                    assert err.value.code() == UNAUTH, err.value.details()
                silent = ch.stream_stream("/test.Internal/ss")(timeout=5 + REFUSE_WAIT_S)
                t0 = asyncio.get_running_loop().time()
                assert await silent.code() == UNAUTH
                assert asyncio.get_running_loop().time() - t0 < 4 + REFUSE_WAIT_S
            assert echo.calls == 0
        finally:
            await server.drain(0.1)

    asyncio.run(run())


def test_without_secrets_everything_is_open_and_only_the_key_guards_the_public_api() -> None:
    async def run() -> None:
        open_server = GrpcServer(["test.Public", "test.Internal"], "127.0.0.1", 0, auth=AuthConfig())
        Echo().register(open_server.server)
        # only a key: the internal links stay open (no token configured)
        keyed = GrpcServer(
            ["test.Public", "test.Internal"],
            "127.0.0.1",
            0,
            auth=AuthConfig(api_key=KEY),
            public_services=["test.Public"],
        )
        Echo().register(keyed.server)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{await open_server.start()}") as ch:
                assert await call_all(ch, "test.Public") == SERVED
                assert await call_all(ch, "test.Internal") == SERVED
            async with grpc.aio.insecure_channel(f"127.0.0.1:{await keyed.start()}") as ch:
                assert [r[0] for r in await call_all(ch, "test.Public")] == [UNAUTH] * 4
                assert await call_all(ch, "test.Internal") == SERVED
        finally:
            await open_server.drain(0.1)
            await keyed.drain(0.1)

    asyncio.run(run())


# ---- meshlm launch: secrets by environment, never argv ------------------------------------------
def test_launch_plan_passes_secrets_by_environment_only() -> None:
    from meshlm.launch.launcher import LaunchPlan, child_env, plan_children

    plan = LaunchPlan(model_path="/m", tokenizer_path="/m", api_key=KEY, decode_dp_size=1).with_internal_token()
    token = plan.internal_token
    assert token and len(token) >= 32 and KEY not in repr(plan) and token not in repr(plan)
    assert LaunchPlan(model_path="/m", tokenizer_path="/m").with_internal_token().internal_token is None
    inherited = {"PATH": "/bin", "MESHLM_TOKENIZER_API_KEY_FILE": "/stale", "MESHLM_SCHEDULER_INTERNAL_TOKEN": "old"}
    children = plan_children(plan)
    assert {c.component for c in children} == {"gateway", "tokenizer", "scheduler", "detokenizer"}
    for child in children:
        assert not any(KEY in a or token in a for a in child.argv), child.name
        env = child_env(inherited, child)
        prefix = f"MESHLM_{child.component.upper()}_"
        assert env[prefix + "INTERNAL_TOKEN"] == token and env["PATH"] == "/bin"
        assert env.get(prefix + "API_KEY") == (KEY if child.component in ("gateway", "tokenizer") else None)
        assert prefix + "API_KEY_FILE" not in env  # the plan alone decides the children's auth
