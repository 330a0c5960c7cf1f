"""create_app(config) -> FastAPI: routes, API keys, Prometheus metrics and OpenTelemetry spans.

Middleware (pure ASGI, so streaming and client-disconnect detection are untouched), outermost first:
  * telemetry: one `http <route>` span per request (an incoming `traceparent` header is its parent;
    the span's traceparent travels in every gRPC request's TraceContext), plus
    meshlm:http_requests_total{route,status} and meshlm:http_request_duration_seconds{route};
  * CORS (any origin, as SGLang);
  * API key: `Authorization: Bearer <key>` when --api-key is set; /health, /health_generate,
    /metrics and CORS preflights are exempt; otherwise 401 in OpenAI's error shape;
  * body limit: a request body over --max-request-bytes is a 413 (body_limit.py).

A direct SSE stream's body chunks skip these wrappers, which act on `http.response.start` alone:
GatewayApp puts the server's own `send` in the scope (sse_direct.SERVER_SEND) before the first
middleware runs.

FastAPI's own OpenTelemetry instrumentation (FastAPI >= 0.165 turns it on whenever an SDK tracer
provider is installed, as every meshlm service does) is switched off: the telemetry middleware
above is the gateway's one HTTP span, so a trace holds no second, duplicate server span nor
FastAPI's per-operation spans, and a streamed token passes one `send` wrapper fewer.
"""

from __future__ import annotations

import hmac
import inspect
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.common import telemetry
from meshlm.common.metrics import Metrics
from meshlm.gateway import native, native_info, openai_serving
from meshlm.gateway.body_limit import BodyLimitMiddleware
from meshlm.gateway.config import GatewayConfig
from meshlm.gateway.errors import error_response, install_error_handlers
from meshlm.gateway.grpc_client import TokenizerPool
from meshlm.gateway.openapi_doc import install_openapi
from meshlm.gateway.sse_direct import SERVER_SEND
from meshlm.gateway.state import GatewayState

AUTH_EXEMPT_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
VERSION = "0.1.0"


def fastapi_telemetry_off() -> dict[str, Any]:
    """FastAPI's keyword arguments that switch its built-in telemetry off (none where this
    FastAPI has none)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


class GatewayMetrics:
    def __init__(self) -> None:
        self.metrics = Metrics()
        self.requests = self.metrics.counter(
            "http_requests_total", "HTTP requests by route and status", ("route", "status")
        )
        self.duration = self.metrics.histogram(
            "http_request_duration_seconds", "HTTP request latency (to the last byte)", ("route",)
        )
        self.stalled_streams = self.metrics.counter(
            "stalled_streams_total", "SSE streams dropped because the client did not read (stream_stall_timeout_s)"
        )

    def render(self) -> bytes:
        return generate_latest(self.metrics.registry)


def route_of(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The matched route template (bounded label cardinality); "other" when nothing matches."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", "other")
        if match == Match.PARTIAL and partial is None:
            partial = getattr(route, "path", None)
    return partial or "other"


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


class TelemetryMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(self.routes, scope)
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        start = time.perf_counter()
        attributes = {"http.method": scope["method"], "http.route": route}
        with telemetry.span(
            f"http {route}", _header(scope, b"traceparent"), _header(scope, b"tracestate"), attributes
        ) as span:
            try:
                await self.app(scope, receive, send_with_status)
            finally:
                span.set_attribute("http.status_code", status)
                self.metrics.requests.labels(route, str(status)).inc()
                self.metrics.duration.labels(route).observe(time.perf_counter() - start)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or scope["path"] in AUTH_EXEMPT_PATHS
            or hmac.compare_digest(_header(scope, b"authorization").encode("latin-1"), self.expected)
        ):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401, "Unauthorized: send the API key as `Authorization: Bearer <key>`", code="invalid_api_key"
        )
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class GatewayApp(FastAPI):
    """FastAPI whose requests carry the server's own ASGI `send` in their scope (SERVER_SEND), for
    the direct SSE path (sse_direct.DirectSend); the outermost middleware runs after this."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig, pool: TokenizerPool | None = None) -> FastAPI:
    """The gateway app. Nothing connects until the first request (or the lifespan's start-up, which
    begins re-resolving and health-checking the tokenizer replicas)."""
    state = GatewayState(config, pool)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        try:
            yield
        finally:
            await state.pool.close()

    app = GatewayApp(
        title="meshlm gateway",
        version=VERSION,
        description="OpenAI-compatible and SGLang-native HTTP API of meshlm (answers come from tokenizer replicas "
        "over gRPC).",
        lifespan=lifespan,
        docs_url="/docs",
        openapi_url="/openapi.json",
        **fastapi_telemetry_off(),
    )
    app.state.gateway = state
    app.state.metrics = metrics
    install_error_handlers(app)
    install_openapi(app, state)
    app.include_router(openai_serving.router)
    app.include_router(native.router)
    app.include_router(native_info.router)

    @app.get("/metrics", tags=["SGLang-native"], response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=config.auth.api_key_value)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    routes = [
        *openai_serving.router.routes,
        *native.router.routes,
        *native_info.router.routes,
        *(r for r in app.router.routes if hasattr(r, "path")),
    ]
    app.add_middleware(TelemetryMiddleware, metrics=metrics, routes=routes)
    return app


def app_factory() -> Any:
    """For `uvicorn --factory meshlm.gateway.app:app_factory` (config from MESHLM_GATEWAY_* env)."""
    import argparse

    parser = argparse.ArgumentParser()
    GatewayConfig.add_cli_args(parser)
    return create_app(GatewayConfig.from_cli_args(parser.parse_args([])))
