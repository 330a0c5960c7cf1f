"""The detokenizer's Prometheus metrics (docs/ring.md: num_active_requests, batches_total)."""

from __future__ import annotations

from meshlm.common.metrics import Metrics


class DetokenizerMetrics:
    """`meshlm:num_active_requests` (requests with a decode state) and `meshlm:batches_total`
    (BatchTokenIDOut messages decoded), in their own registry."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.num_active_requests = self.metrics.gauge(
            "num_active_requests", "Requests whose decode state the detokenizer holds"
        )
        self.batches_total = self.metrics.counter("batches_total", "BatchTokenIDOut messages detokenized")

    def serve(self, port: int | None, host: str = "0.0.0.0") -> None:
        self.metrics.serve(port, host)
