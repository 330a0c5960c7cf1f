"""Bearer tokens on meshlm's gRPC links: the server interceptor that checks them and the client
interceptors that send them (meshlm.common.auth holds the secrets).

Server (`server_interceptors`, installed by GrpcServer): each RPC is allowed by its service:
* grpc.health.v1 and server reflection are always open (as the gateway's HTTP /health is);
* a public service (the tokenizer's TokenizerService) needs `authorization: Bearer <API key>`
  when an API key is configured; the internal token is accepted too (the gateway's client sends
  it), so the ring works with both set;
* every other service is an internal link (SchedulerService, DetokenizerService): it needs
  `authorization: Bearer <internal token>` when an internal token is configured.
A refused call ends with UNAUTHENTICATED and a message saying which credential the service
wants, before its handler runs. Keys are compared in constant time (hmac.compare_digest) against
every accepted secret.

Client (`bearer_interceptors`, used by meshlm.common.channels.Dialer): every call of the channel
carries `authorization: Bearer <token>`, for all four call kinds (grpc.aio sorts an interceptor
into one kind only, so there is one object per kind).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from meshlm.common.auth import AuthConfig
from meshlm.common.deadline import within

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
REFUSE_WAIT_S = 1.0  # how long a refused streaming call may take to send its first message
OPEN_SERVICES = frozenset(
    {
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


def bearer(secret: str) -> str:
    return f"Bearer {secret}"


@dataclass(frozen=True)
class Requirement:
    """What one kind of service accepts: any of `secrets` as a bearer token. `wants` names the
    credential in the refusal message."""

    secrets: tuple[str, ...]
    wants: str

    def refusal(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """None when the call's metadata carries an accepted token, else why not."""
        presented = next((v for k, v in metadata or () if k == AUTHORIZATION), None)
        if presented is None:
            return f"missing `authorization: Bearer <{self.wants}>` metadata"
        given = presented.encode() if isinstance(presented, str) else bytes(presented)
        # Compare with every secret (no early exit): the time does not tell which one nearly matched.
        matches = [hmac.compare_digest(given, bearer(s).encode()) for s in self.secrets]
        return None if any(matches) else f"the `authorization` metadata does not hold a valid {self.wants}"


def requirements(auth: AuthConfig, public: bool) -> Requirement | None:
    """What a public / internal service of this server requires (None: open)."""
    key, token = auth.api_key_value, auth.internal_token_value
    if public:
        if key is None:
            return None
        return Requirement(tuple(s for s in (key, token) if s is not None), "API key")
    if token is None:
        return None
    return Requirement((token,), "internal token")


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        if handler.request_streaming:
            # Take the client's first message (or its half-close) before ending the call: a
            # client that writes and then reads (the ring's Push) otherwise races its write
            # against the abort, and gRPC reports a lost race to it as INTERNAL ("Internal error
            # from Core") instead of this refusal. Bounded: a silent client is refused after
            # REFUSE_WAIT_S. The message is never looked at.
            with contextlib.suppress(Exception):
                await within(anext(aiter(request), None), REFUSE_WAIT_S)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """Checks every call's bearer token against its service's requirement (module docstring)."""

    LOG_EVERY_S = 60.0  # a refused internal call is logged at most this often per method

    def __init__(
        self, public_services: Sequence[str], public: Requirement | None, internal: Requirement | None
    ) -> None:
        self.public_services = frozenset(public_services)
        self.public, self.internal = public, internal
        self._logged: dict[str, float] = {}  # method -> when its last refusal was logged

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method or ""
        service = method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES:
            return await continuation(handler_call_details)
        need = self.public if service in self.public_services else self.internal
        why = None if need is None else need.refusal(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if why is None or handler is None:
            return handler
        assert need is not None
        now = time.monotonic()
        if need is self.internal and now - self._logged.get(method, -self.LOG_EVERY_S) >= self.LOG_EVERY_S:
            self._logged[method] = now  # a misconfiguration is worth a line; a flood of probes is not
            logger.warning("refused %s: %s (is every component given the same internal token?)", method, why)
        return _refuse(handler, f"{service} requires the {need.wants}: {why}")


def server_interceptors(
    auth: AuthConfig | None, public_services: Sequence[str] = ()
) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a GrpcServer needs for `auth` (none when it configures no secret)."""
    if auth is None or not auth.enabled:
        return []
    public = requirements(auth, public=True)
    internal = requirements(auth, public=False)
    if public is None and internal is None:
        return []
    return [AuthInterceptor(public_services, public, internal)]


# ---- client side ----------------------------------------------------------------------------
class _Bearer:
    def __init__(self, token: str) -> None:
        self._value = bearer(token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(AUTHORIZATION, self._value)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that put `authorization: Bearer <token>` on every call (none: [])."""
    if token is None:
        return []
    return [cls(token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


__all__ = ["AuthInterceptor", "OPEN_SERVICES", "Requirement", "bearer_interceptors", "server_interceptors"]
