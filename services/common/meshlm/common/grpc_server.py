"""gRPC server bootstrap shared by every service: grpc.health.v1, server reflection, message
size limits, TLS / mTLS (meshlm.common.tls), bearer-token authentication (meshlm.common.auth:
the API key on public services, the internal token on the others; health and reflection stay
open), requests that do not parse as INVALID_ARGUMENT (meshlm.common.grpc_decode), and graceful
drain on SIGTERM/SIGINT.

With a health port, a second, plaintext server serves grpc.health.v1 and nothing else (the same
statuses, from the same servicer): Kubernetes' gRPC probes cannot speak TLS. It starts and stops
with the main server.

Drain: health flips to NOT_SERVING (Kubernetes stops routing), the service's own `on_drain`
hook runs (stop accepting, finish or abort in-flight work), then the server stops with a
grace period and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshlm.common.auth import AuthConfig
from meshlm.common.auth_interceptors import server_interceptors
from meshlm.common.channels import MAX_MESSAGE_BYTES
from meshlm.common.deadline import within
from meshlm.common.grpc_decode import BadMessageInterceptor
from meshlm.common.tls import PLAINTEXT, TlsConfig

logger = logging.getLogger(__name__)

DrainHook = Callable[[], Awaitable[None]]


class GrpcServer:
    """One service's grpc.aio server. Invariants: the service port is bound once (bind() or
    start()), with TLS exactly when `tls` is enabled (mTLS when it has a CA); every call but
    health and reflection passes `auth`'s check (public_services: those that take the API key;
    the rest take the internal token); the health servicer holds every status, for the service
    port and the plaintext health port alike."""

    def __init__(
        self,
        service_names: Sequence[str],
        host: str = "0.0.0.0",
        port: int = 0,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls: TlsConfig | None = None,
        health_port: int | None = None,
        auth: AuthConfig | None = None,
        public_services: Sequence[str] = (),
    ) -> None:
        self.auth_enabled = auth is not None and auth.enabled
        self.server = grpc.aio.server(
            # Auth first; innermost, a unary request that does not parse is INVALID_ARGUMENT
            # (grpc_decode.py).
            interceptors=[*interceptors, *server_interceptors(auth, public_services), BadMessageInterceptor()],
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        names = self.service_names + [
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        self.address = f"{host}:{port}"
        self.port = 0
        self.tls = tls or PLAINTEXT
        self.health_server: grpc.aio.Server | None = None
        self.health_address = f"{host}:{health_port}" if health_port is not None else None
        self._stopped = asyncio.Event()

    def bind(self) -> int:
        """Bind the service port (TLS when configured) once; returns the bound port."""
        if self.port:
            return self.port
        if self.tls.enabled:
            self.port = self.server.add_secure_port(self.address, self.tls.server_credentials())
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind gRPC server to {self.address}")
        return self.port

    async def _start_health_server(self) -> None:
        if self.health_address is None or self.health_server is not None:
            return
        self.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        if self.health_server.add_insecure_port(self.health_address) == 0:
            raise RuntimeError(f"cannot bind the plaintext health server to {self.health_address}")
        await self.health_server.start()
        logger.info("grpc.health.v1 (plaintext) listening on %s", self.health_address)

    async def start(self) -> int:
        """Bind (unless bind() ran) and start, with the health server if any; returns the bound
        port (useful with port 0). Health: SERVING."""
        self.bind()
        await self.server.start()
        await self._start_health_server()
        await self.set_serving(True)
        logger.info(
            "gRPC %s listening on port %d (%s%s)",
            ",".join(self.service_names),
            self.port,
            ("mTLS" if self.tls.mutual else "TLS") if self.tls.enabled else "plaintext",
            ", bearer tokens required" if self.auth_enabled else "",
        )
        return self.port

    async def stop(self, grace: float | None) -> None:
        """Stop the server and the health server (grace as grpc.aio.Server.stop)."""
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        for name in self.service_names:
            await self.health.set(name, status)

    async def drain(self, grace_s: float, on_drain: DrainHook | None = None) -> None:
        """NOT_SERVING, run the service's drain hook (bounded by grace_s), stop the server."""
        await self.set_serving(False)
        if on_drain is not None:
            try:
                await within(on_drain(), grace_s)
            except asyncio.TimeoutError:
                logger.warning("drain did not finish within %.1fs; stopping anyway", grace_s)
        await self.stop(grace=min(grace_s, 5.0))
        self._stopped.set()

    async def serve_until_signal(self, grace_s: float, on_drain: DrainHook | None = None) -> None:
        """Run until SIGTERM/SIGINT (or stop()), then drain. Returns when stopped."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.create_task(self.server.wait_for_termination())
        signalled = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({waiter, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if signalled in done:
            logger.info("signal received: draining (grace %.1fs)", grace_s)
            await self.drain(grace_s, on_drain)
        elif self.health_server is not None:
            await self.health_server.stop(None)
        waiter.cancel()
        signalled.cancel()
