"""The OpenTelemetry spans a test's code emits, captured in memory."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def capture_spans() -> InMemorySpanExporter:
    """An in-memory exporter added to the process's SDK tracer provider (installed first if there is
    none yet); the calling test is skipped when a provider of another kind holds the process."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        pytest.skip("another tracer provider is installed in this process")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
