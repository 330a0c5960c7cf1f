"""The tokenizer's Prometheus metrics (SGLang's TokenizerMetricsCollector names, `meshlm:` prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.common.finish import FinishReason
from meshlm.common.metrics import Metrics

if TYPE_CHECKING:
    from meshlm.tokenizer.state import ReqState

# Inter-token latencies are small; finer buckets than the shared latency ones.
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5)


class TokenizerMetrics:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        m = self.metrics
        self.time_to_first_token = m.histogram("time_to_first_token_seconds", "Time to first token (s).")
        self.inter_token_latency = m.histogram(
            "inter_token_latency_seconds", "Time between output tokens (s).", buckets=ITL_BUCKETS
        )
        self.e2e_request_latency = m.histogram("e2e_request_latency_seconds", "End-to-end request latency (s).")
        self.num_requests = m.counter("num_requests_total", "Finished requests (one per output).")
        self.num_aborted_requests = m.counter("num_aborted_requests_total", "Aborted requests.")
        self.num_slow_stream_aborts = m.counter(
            "num_slow_stream_aborts_total", "Calls aborted: their caller did not read (max_stream_backlog_bytes)."
        )
        self.prompt_tokens = m.counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = m.counter("generation_tokens_total", "Generated tokens of finished requests.")

    def observe_inter_token(self, interval: float, num_tokens: int) -> None:
        """SGLang's rule: a delta of k tokens after `interval` counts k latencies of interval/k."""
        if num_tokens <= 0:
            return
        per = interval / num_tokens
        for _ in range(min(num_tokens, 64)):
            self.inter_token_latency.observe(per)

    def observe_tokens(self, state: ReqState, num_ids: int, now: float) -> None:
        """A delta with output of a Generate request: its first token, or num_ids more."""
        if state.first_at is None:
            state.first_at = now
            self.time_to_first_token.observe(now - state.call.started)
        elif num_ids:
            self.observe_inter_token(now - (state.last_at or now), num_ids)
        if num_ids:
            state.last_at = now

    def observe_finish(self, state: ReqState, finish: FinishReason, now: float) -> None:
        self.num_requests.inc()
        self.e2e_request_latency.observe(now - state.call.started)
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        if finish.is_abort:
            self.num_aborted_requests.inc()

    def serve(self, port: int | None) -> None:
        self.metrics.serve(port)
