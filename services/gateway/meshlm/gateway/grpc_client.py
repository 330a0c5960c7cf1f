"""The gateway's side of TokenizerService: a pool of tokenizer channels with one typed method
per RPC (`embed`, `tokenize`, ..., `generate`, `abort_everywhere`).

* Replicas come from `--tokenizer-addrs`; each address is re-resolved (a headless-service name gives
  one endpoint per pod). Requests go round robin over healthy endpoints (grpc.health.v1 checks in
  the background, and at once on a failure); a session id pins its requests to one endpoint.
* Channels come from meshlm.common.channels.Dialer (the ring's channel options and message limit);
  with --tls-* flags they use TLS (mTLS with a CA), each endpoint's certificate checked against the
  name it was resolved from; with a token (the gateway's internal token or API key) every call
  carries `authorization: Bearer <token>`.
* Generate calls share one TokenizerService.GenerateStream call per endpoint (generate_mux.py:
  one gRPC message per engine step for all requests instead of one per response); against a
  tokenizer without it (UNIMPLEMENTED: an older release) each is a Generate call of its own.
* A call that fails with UNAVAILABLE before any output is retried on another endpoint; so is a
  Generate refused with RESOURCE_EXHAUSTED (another replica may have room).
* gRPC status -> ServiceError (meshlm.common.errors), which the app renders as the HTTP error.
* Cancellation: `cancel_on_disconnect` runs a call while watching the HTTP client; when the client
  goes away the task (and with it the gRPC call) is cancelled, and the tokenizer aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import Request

from meshlm.common.channels import Dialer
from meshlm.common.errors import ServiceError
from meshlm.common.telemetry import current_traceparent
from meshlm.common.tls import TlsConfig
from meshlm.gateway.generate_mux import GenerateMux, GenerateStream, status_error
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}


def to_service_error(e: grpc.aio.AioRpcError, address: str = "") -> ServiceError:
    return status_error(e.code(), e.details() or "", address)


def sampling_params(values: dict[str, Any]) -> common_pb2.SamplingParams:
    """SGLang-style sampling dict -> SamplingParams; None means unset (the server default)."""
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        if key not in _SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling parameter {key!r}")
        if key == "stop":
            value = [value] if isinstance(value, str) else list(value)
        elif key == "logit_bias":
            value = {int(k): float(v) for k, v in value.items()}
        kwargs[key] = value
    return common_pb2.SamplingParams(**kwargs)


def trace_context() -> common_pb2.TraceContext:
    """The current span (the gateway's `http <route>` span) as the request's TraceContext."""
    traceparent, tracestate = current_traceparent()
    return common_pb2.TraceContext(traceparent=traceparent, tracestate=tracestate)


Reply = TypeVar("Reply")
# One call of one endpoint's stub: (stub, timeout in s) -> the reply.
StubCall = Callable[[tokenizer_pb2_grpc.TokenizerServiceStub, float], Awaitable[Reply]]


class _Endpoint:
    def __init__(self, address: str, dialer: Dialer) -> None:
        self.address = address
        self.channel = dialer.channel(address)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = True  # optimistic until a check says otherwise
        self.checked_at = 0.0
        self.checking: asyncio.Task | None = None
        self.mux = GenerateMux(self.stub, address)
        self.mux_supported = True  # until it answers UNIMPLEMENTED (probed again after a restart)


class CallStream(GenerateStream):
    """A Generate call whose first response (if any) has already arrived."""

    def __init__(self, call: Any, first: tokenizer_pb2.GenerateResponse | None, address: str) -> None:
        self.call = call
        self.first = first
        self.address = address

    async def next_response(self) -> tokenizer_pb2.GenerateResponse | None:
        try:
            message = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise to_service_error(e, self.address) from None
        return None if message is grpc.aio.EOF else message

    def cancel(self) -> None:
        """Cancel the call if it still runs (the tokenizer then aborts the request)."""
        if not self.call.done():
            self.call.cancel()


class TokenizerPool:
    """Channels to the tokenizer replicas, created lazily in the running event loop."""

    def __init__(
        self,
        addresses: Iterable[str],
        *,
        resolve_interval_s: float = 10.0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 2.0,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.dialer = Dialer(tls, token=token)  # remembers the DNS name each endpoint was resolved from
        self.resolve_interval_s = resolve_interval_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self._endpoints: dict[str, _Endpoint] = {}
        self._resolved: list[str] = list(self.addresses)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rr = 0
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ endpoints
    def _ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # grpc.aio channels belong to the loop that made them
            self._loop, self._endpoints = loop, {}
        if set(self._endpoints) != set(self._resolved):
            kept = {a: self._endpoints.get(a) or _Endpoint(a, self.dialer) for a in self._resolved}
            for address, ep in self._endpoints.items():
                if address not in kept:
                    ep.mux.close()
                    loop.create_task(ep.channel.close(grace=5.0))
            self._endpoints = kept

    def endpoints(self) -> list[_Endpoint]:
        self._ensure()
        return [self._endpoints[a] for a in sorted(self._endpoints)]

    async def refresh(self) -> None:
        """Re-resolve every configured address (pods of a headless service come and go)."""
        resolved = await self.dialer.resolve(self.addresses)
        if resolved != self._resolved:
            logger.info("tokenizer endpoints: %s", ", ".join(resolved))
        self._resolved = resolved
        self._ensure()

    async def check(self, ep: _Endpoint) -> bool:
        """grpc.health.v1 check of one endpoint; updates its health."""
        try:
            reply = await ep.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ok = False
        if ok != ep.healthy:
            logger.warning("tokenizer %s is %s", ep.address, "healthy" if ok else "unhealthy")
            if ok:
                ep.mux_supported = True  # it may be a newer release now
        ep.healthy, ep.checked_at = ok, time.monotonic()
        return ok

    def _recheck(self, ep: _Endpoint) -> None:
        if ep.checking is None or ep.checking.done():
            ep.checking = asyncio.get_running_loop().create_task(self.check(ep))

    async def any_healthy(self) -> bool:
        """True as soon as one tokenizer answers its health check with SERVING."""
        tasks = [asyncio.ensure_future(self.check(ep)) for ep in self.endpoints()]
        try:
            for next_done in asyncio.as_completed(tasks):
                if await next_done:
                    return True
            return False
        finally:
            for t in tasks:
                t.cancel()

    def pick(self, exclude: Iterable[str] = (), key: str | None = None) -> _Endpoint:
        """Round robin over healthy endpoints (all of them if none is healthy); `key` pins by hash."""
        excluded = set(exclude)
        eps = [ep for ep in self.endpoints() if ep.address not in excluded]
        if not eps:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no tokenizer replica is reachable")
        now = time.monotonic()
        for ep in eps:
            if not ep.healthy and now - ep.checked_at > self.health_interval_s:
                self._recheck(ep)
        if key is not None:
            start = zlib.crc32(key.encode()) % len(eps)
            ring = eps[start:] + eps[:start]
            return next((ep for ep in ring if ep.healthy), ring[0])
        healthy = [ep for ep in eps if ep.healthy] or eps
        self._rr = (self._rr + 1) % (1 << 30)
        return healthy[self._rr % len(healthy)]

    def _failed(self, ep: _Endpoint) -> None:
        ep.healthy = False
        self._recheck(ep)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start re-resolution and health checks (the app's lifespan calls this)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        last_resolve = 0.0
        while True:
            try:
                if time.monotonic() - last_resolve >= self.resolve_interval_s:
                    await self.refresh()
                    last_resolve = time.monotonic()
                await asyncio.gather(*(self.check(ep) for ep in self.endpoints()))
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching whatever happens
                logger.exception("tokenizer pool refresh failed")
            await asyncio.sleep(self.health_interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for ep in self._endpoints.values():
            ep.mux.close()
        if self._loop is asyncio.get_running_loop():
            await asyncio.gather(*(ep.channel.close() for ep in self._endpoints.values()), return_exceptions=True)
        self._endpoints = {}

    # ------------------------------------------------------------------ calls
    async def _unary(self, call: StubCall[Reply], *, timeout: float, key: str | None = None) -> Reply:
        """call(one endpoint's stub); UNAVAILABLE is retried on the other endpoints."""
        deadline = time.monotonic() + timeout
        tried: list[str] = []
        while True:
            ep = self.pick(tried, key)
            try:
                return await call(ep.stub, max(deadline - time.monotonic(), 0.001))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._failed(ep)
                    tried.append(ep.address)
                    if len(tried) < len(self._endpoints) and time.monotonic() < deadline:
                        continue
                raise to_service_error(e, ep.address) from None

    async def embed(self, request: tokenizer_pb2.EmbedRequest, *, timeout: float) -> tokenizer_pb2.EmbedResponse:
        return await self._unary(lambda stub, t: stub.Embed(request, timeout=t), timeout=timeout)

    async def tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, *, timeout: float
    ) -> tokenizer_pb2.TokenizeResponse:
        return await self._unary(lambda stub, t: stub.Tokenize(request, timeout=t), timeout=timeout)

    async def detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, *, timeout: float
    ) -> tokenizer_pb2.DetokenizeResponse:
        return await self._unary(lambda stub, t: stub.Detokenize(request, timeout=t), timeout=timeout)

    async def get_model_info(self, *, timeout: float) -> common_pb2.ModelInfo:
        request = common_pb2.GetModelInfoRequest()
        return await self._unary(lambda stub, t: stub.GetModelInfo(request, timeout=t), timeout=timeout)

    async def get_server_info(self, *, timeout: float) -> tokenizer_pb2.ServerInfo:
        request = tokenizer_pb2.GetServerInfoRequest()
        return await self._unary(lambda stub, t: stub.GetServerInfo(request, timeout=t), timeout=timeout)

    async def get_loads(
        self, request: tokenizer_pb2.GetLoadsRequest, *, timeout: float
    ) -> tokenizer_pb2.GetLoadsResponse:
        return await self._unary(lambda stub, t: stub.GetLoads(request, timeout=t), timeout=timeout)

    async def flush_cache(self, *, timeout: float) -> tokenizer_pb2.FlushCacheResponse:
        request = tokenizer_pb2.FlushCacheRequest()
        return await self._unary(lambda stub, t: stub.FlushCache(request, timeout=t), timeout=timeout)

    async def open_session(
        self, request: tokenizer_pb2.OpenSessionRequest, *, timeout: float
    ) -> tokenizer_pb2.OpenSessionResponse:
        """Pinned, like every request of the session, by its id."""
        return await self._unary(
            lambda stub, t: stub.OpenSession(request, timeout=t),
            timeout=timeout,
            key=request.session_id,
        )

    async def close_session(
        self, request: tokenizer_pb2.CloseSessionRequest, *, timeout: float
    ) -> tokenizer_pb2.CloseSessionResponse:
        return await self._unary(
            lambda stub, t: stub.CloseSession(request, timeout=t),
            timeout=timeout,
            key=request.session_id,
        )

    async def abort_everywhere(
        self, request: tokenizer_pb2.AbortRequest, *, timeout: float
    ) -> list[tokenizer_pb2.AbortResponse | ServiceError]:
        """Abort on every endpoint at once (any of them may hold the request); each result is
        the reply or a ServiceError."""

        async def one(ep: _Endpoint) -> tokenizer_pb2.AbortResponse | ServiceError:
            try:
                return await ep.stub.Abort(request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                return to_service_error(e, ep.address)

        return list(await asyncio.gather(*(one(ep) for ep in self.endpoints())))

    async def generate(
        self, request: tokenizer_pb2.GenerateRequest, *, timeout: float, key: str | None = None
    ) -> GenerateStream:
        """Start Generate and wait for its first response, so errors before any output (bad input,
        overload) surface as HTTP errors. Before any output, UNAVAILABLE (the replica is down) and
        RESOURCE_EXHAUSTED (that replica, or the scheduler it chose, is full; the replica stays
        healthy) are retried once on each other replica; the last error is raised at once."""
        deadline = time.monotonic() + timeout
        tried: list[str] = []
        while True:
            ep = self.pick(tried, key)
            try:
                return await self._generate_on(ep, request, deadline)
            except ServiceError as e:
                if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    if e.code == grpc.StatusCode.UNAVAILABLE:
                        self._failed(ep)
                    tried.append(ep.address)
                    if len(tried) < len(self._endpoints) and time.monotonic() < deadline:
                        continue
                raise

    async def _generate_on(
        self, ep: _Endpoint, request: tokenizer_pb2.GenerateRequest, deadline: float
    ) -> GenerateStream:
        """Generate on one endpoint: over its GenerateStream call, else as a call of its own."""
        if ep.mux_supported:
            try:
                return await ep.mux.generate(request, deadline)
            except ServiceError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                ep.mux_supported = False
                logger.warning(
                    "tokenizer %s has no GenerateStream (an older release): a Generate call each", ep.address
                )
        call = ep.stub.Generate(request, timeout=max(deadline - time.monotonic(), 0.001))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise to_service_error(e, ep.address) from None
        except BaseException:
            call.cancel()
            raise
        return CallStream(call, None if first is grpc.aio.EOF else first, ep.address)


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the HTTP client disconnects (the body has been read already)."""
    if await request.is_disconnected():
        return
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` while watching the client; on disconnect cancel it (and its gRPC call)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we are cancelled ourselves (shutdown): take the call down with us
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientDisconnected()
    return task.result()
