"""OpenTelemetry tracing shared by every service.

`setup_telemetry(service, endpoint)` installs a tracer provider that exports spans over OTLP/gRPC
when an endpoint is set. Otherwise it installs nothing: OpenTelemetry's API then makes
non-recording spans (~20 us a span less than an SDK provider that records them for no one), and
an incoming traceparent still passes through to the next service. Trace context crosses our shared
internal streams inside each message (TraceContext: W3C traceparent/tracestate), not in gRPC
metadata, so `span(..., traceparent=...)` continues the request's trace in any service.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "meshlm"


def setup_telemetry(service_name: str, otlp_endpoint: str | None) -> None:
    """Install the process's exporting tracer provider (once, at start-up) when there is an
    endpoint to export to; without one, nothing (see the module docstring)."""
    if not otlp_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    endpoint = otlp_endpoint.removeprefix("http://").removeprefix("grpc://")
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True), schedule_delay_millis=200)
    )
    trace.set_tracer_provider(provider)


def shutdown_telemetry() -> None:
    """Flush pending spans (call before exit)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush(timeout_millis=3000)
    stop = getattr(provider, "shutdown", None)
    if stop is not None:
        stop()


def tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


def context_from(traceparent: str, tracestate: str = "") -> otel_context.Context:
    """An OTel context whose parent is the remote span named by a W3C traceparent."""
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier) if traceparent else otel_context.Context()


def current_traceparent(span: trace.Span | None = None) -> tuple[str, str]:
    """(traceparent, tracestate) of `span` (default: the current span); ("", "") if none."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


@contextlib.contextmanager
def span(
    name: str, traceparent: str = "", tracestate: str = "", attributes: dict[str, Any] | None = None
) -> Iterator[trace.Span]:
    """A span that continues the trace named by traceparent (or the current one if empty)."""
    parent = context_from(traceparent, tracestate) if traceparent else None
    with tracer().start_as_current_span(name, context=parent, attributes=attributes or {}) as s:
        yield s


def start_span(
    name: str,
    traceparent: str = "",
    tracestate: str = "",
    attributes: dict[str, Any] | None = None,
    start_time_ns: int | None = None,
) -> trace.Span:
    """A span not bound to the current context (for work that outlives a call, e.g. a
    request inside the scheduler loop); the caller ends it with span.end()."""
    parent = context_from(traceparent, tracestate) if traceparent else None
    return tracer().start_span(name, context=parent, attributes=attributes or {}, start_time=start_time_ns)
