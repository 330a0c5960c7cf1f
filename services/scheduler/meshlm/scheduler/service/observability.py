"""Scheduler metrics (Prometheus, SGLang's names under `meshlm:`) and per-request spans.

Spans `scheduler.queue` (arrival -> first prefill), `scheduler.prefill` (first prefill -> first
token) and `scheduler.decode` (first token -> finish) are children of the request's
TraceContext. They are emitted here, on the service side, with the explicit wall-clock times the
engine records on each request (io_struct.ReqTimes), so the loop thread does no tracing work.
"""

from __future__ import annotations

from opentelemetry.trace import Status, StatusCode

from meshlm.common import telemetry
from meshlm.common.metrics import Metrics
from meshlm.scheduler.managers.io_struct import LoadReport
from meshlm.scheduler.service.tracker import TrackedRequest


def _ns(t: float) -> int:
    return int(t * 1e9)


class SchedulerMetrics:
    def __init__(self, metrics: Metrics) -> None:
        m = metrics
        self.num_running_reqs = m.gauge("num_running_reqs", "Requests running (decoding or prefilling)")
        self.num_queue_reqs = m.gauge("num_queue_reqs", "Requests waiting in the queue")
        self.num_used_tokens = m.gauge("num_used_tokens", "KV cache slots held by requests")
        self.token_usage = m.gauge("token_usage", "Fraction of the KV cache held by requests")
        self.max_total_num_tokens = m.gauge("max_total_num_tokens", "KV cache size in tokens")
        self.cache_hit_rate = m.gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens")
        self.num_retracted_reqs = m.gauge("num_retracted_reqs", "Retracted requests waiting to run again")
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = m.counter("generation_tokens", "Generated tokens")
        self.cached_tokens = m.counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.queue_time = m.histogram("queue_time_seconds", "Time from arrival to the first prefill")
        self.num_grammar_queue_reqs = m.gauge(
            "num_grammar_queue_reqs", "Constrained requests waiting for their grammar"
        )
        self.grammar_compilation_time = m.histogram(
            "grammar_compilation_time_seconds",
            "Time to compile one grammar (json_schema / regex / ebnf); cache hits are not compiles",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )

    def update_load(self, load: LoadReport) -> None:
        self.num_running_reqs.set(load.num_running_reqs)
        self.num_queue_reqs.set(load.num_queue_reqs)
        self.num_used_tokens.set(load.num_used_tokens)
        self.token_usage.set(load.token_usage)
        self.max_total_num_tokens.set(load.max_total_num_tokens)
        self.cache_hit_rate.set(load.cache_hit_rate)
        self.num_retracted_reqs.set(load.num_retracted_reqs)
        self.num_grammar_queue_reqs.set(load.num_grammar_queue_reqs)


class RequestObserver:
    """Counts tokens and emits phase spans as a request's outputs go by."""

    def __init__(self, metrics: SchedulerMetrics | None, scheduler_id: str) -> None:
        self.metrics = metrics
        self.scheduler_id = scheduler_id

    def on_emit(self, t: TrackedRequest, new_tokens: int) -> None:
        """After the tracker recorded an emission of t (new_tokens output ids)."""
        m = self.metrics
        first = t.emissions == 1
        if m is not None:
            if first and t.sent is not None and not t.is_embedding:
                m.prompt_tokens.inc(t.sent.prompt_tokens)
                m.cached_tokens.inc(t.sent.cached_tokens)
            if new_tokens:
                m.generation_tokens.inc(new_tokens)
        times = t.times
        if times is None or t.sent is None:
            return
        if times.scheduled and "queue" not in t.spans_emitted:
            self._span(t, "queue", times.arrival, times.scheduled)
            if m is not None:
                m.queue_time.observe(max(times.scheduled - times.arrival, 0.0))
        if times.scheduled and times.first_token and "prefill" not in t.spans_emitted:
            self._span(t, "prefill", times.scheduled, times.first_token)
        if t.finished:
            end = times.finished or times.first_token or times.scheduled or times.arrival
            if not times.scheduled and "queue" not in t.spans_emitted:
                self._span(t, "queue", times.arrival, end)  # ended before it ever ran
            elif times.first_token and "decode" not in t.spans_emitted:
                self._span(t, "decode", times.first_token, end)

    def _span(self, t: TrackedRequest, phase: str, start: float, end: float) -> None:
        t.spans_emitted.add(phase)
        sent = t.sent
        assert sent is not None  # spans follow token outputs only
        attrs: dict[str, str | int] = {
            "meshlm.rid": t.rid,
            "meshlm.origin": t.origin,
            "meshlm.scheduler_id": self.scheduler_id,
        }
        if phase == "prefill":
            attrs["meshlm.prompt_tokens"] = sent.prompt_tokens
            attrs["meshlm.cached_tokens"] = sent.cached_tokens
        if phase == "decode" or (phase == "queue" and t.finished):
            attrs["meshlm.completion_tokens"] = sent.completion_tokens
        span = telemetry.start_span(
            f"scheduler.{phase}", t.trace.traceparent, t.trace.tracestate, attrs, start_time_ns=_ns(start)
        )
        finish = sent.finish_reason
        if finish is not None and finish.is_abort and phase != "prefill":
            span.set_status(Status(StatusCode.ERROR, finish.message))
        span.end(end_time=max(_ns(end), _ns(start)))
