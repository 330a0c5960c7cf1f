"""Prometheus metrics: SGLang's names under the `meshlm:` prefix, one registry per process.

gRPC services expose them over HTTP on `--metrics-port`; the gateway serves them at /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PREFIX = "meshlm:"

# Latency buckets (seconds) spanning CPU and GPU serving.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def name(metric: str) -> str:
    return PREFIX + metric


class Metrics:
    """A registry plus constructors that apply the prefix; each service declares its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, metric: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name(metric), doc, labels, registry=self.registry)

    def gauge(self, metric: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name(metric), doc, labels, registry=self.registry)

    def histogram(
        self, metric: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name(metric), doc, labels, buckets=buckets, registry=self.registry)

    def serve(self, port: int | None, host: str = "0.0.0.0") -> None:
        """Expose /metrics over HTTP when a port is configured."""
        if port:
            start_http_server(port, addr=host, registry=self.registry)
