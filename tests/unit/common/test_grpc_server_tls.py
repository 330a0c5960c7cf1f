"""GrpcServer with mTLS and a plaintext health port, in process: the service port accepts only
clients with a certificate of its CA, the health port serves grpc.health.v1 (and nothing else) in
plaintext with the same statuses, and a client dialing an IP checks the certificate against the
DNS name it was given."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tests.tls_certs import make_pki

from meshlm.common.grpc_server import GrpcServer
from meshlm.common.tls import TlsConfig, aio_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def _rejected(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _check(channel)
    await channel.close()
    return err.value.code()


def test_mtls_server_and_plaintext_health_port(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "ours", dns_names=("peer.meshlm.test",), ip_addresses=())
    other = make_pki(tmp_path / "other", dns_names=("peer.meshlm.test",), ip_addresses=())
    health_port = _free_port()

    async def run() -> None:
        server = GrpcServer(["test.Service"], "127.0.0.1", 0, tls=pki.tls(), health_port=health_port)
        port = await server.start()
        address = f"127.0.0.1:{port}"
        try:
            # the certificate names peer.meshlm.test, not 127.0.0.1: the override makes it match
            async with aio_channel(address, pki.tls(), server_name="peer.meshlm.test") as ch:
                assert await _check(ch) == SERVING
            assert await _rejected(aio_channel(address, pki.tls())) == grpc.StatusCode.UNAVAILABLE
            assert await _rejected(aio_channel(address)) == grpc.StatusCode.UNAVAILABLE
            foreign = aio_channel(address, other.tls(), server_name="peer.meshlm.test")
            assert await _rejected(foreign) == grpc.StatusCode.UNAVAILABLE
            no_client_cert = grpc.aio.secure_channel(
                address,
                grpc.ssl_channel_credentials(pki.ca_file.read_bytes()),
                options=[("grpc.ssl_target_name_override", "peer.meshlm.test")],
            )
            assert await _rejected(no_client_cert) == grpc.StatusCode.UNAVAILABLE

            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                assert await _check(ch) == SERVING
                await server.set_serving(False)
                assert await _check(ch) == NOT_SERVING
                reflection = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in reflection:
                        pass
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # health only
        finally:
            await server.drain(0.1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            assert await _rejected(ch) == grpc.StatusCode.UNAVAILABLE  # stopped with the server

    asyncio.run(run())


def test_one_way_tls_asks_no_client_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    server_tls = pki.tls(mutual=False)

    async def run() -> None:
        server = GrpcServer(["test.Service"], "127.0.0.1", 0, tls=server_tls)
        port = await server.start()
        try:
            verify_only = grpc.aio.secure_channel(
                f"127.0.0.1:{port}", grpc.ssl_channel_credentials(pki.ca_file.read_bytes())
            )
            async with verify_only as ch:
                assert await _check(ch) == SERVING
            async with aio_channel(f"127.0.0.1:{port}", pki.tls()) as ch:
                assert await _check(ch) == SERVING
        finally:
            await server.drain(0.1)

    asyncio.run(run())


def test_plaintext_server_is_unchanged() -> None:
    async def run() -> None:
        server = GrpcServer(["test.Service"], "127.0.0.1", 0, tls=TlsConfig())
        port = await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}") as ch:
                assert await _check(ch) == SERVING
            assert server.health_server is None
        finally:
            await server.drain(0.1)

    asyncio.run(run())
