"""The DetokenizerManager: decode each step, route the text to each request's origin.

Invariants:
- One subscriber per origin (the latest Subscribe wins; the previous stream ends and whatever it
  had not sent moves, in order, to the new one).
- Each step's outputs reach a subscriber as one message per origin, in step order.
- Outputs for an origin with no subscriber are held for `undelivered_hold_s` and handed to the
  origin's next subscriber in order; after that they are dropped with a log line naming the rids.
- A `detokenize` span per traced request: started at its first delta (child of the request's
  TraceContext), ended when it finishes, fails, is re-seeded or its state is evicted.
- Everything runs on the event loop thread; `handle_tokens` never awaits, so the steps of one
  Push stream are decoded in order and no two steps interleave.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from opentelemetry.trace import Span, Status, StatusCode

from meshlm.common import telemetry
from meshlm.detokenizer.batches import split_embeddings, str_outputs, token_delta
from meshlm.detokenizer.decoder import TextDecoder
from meshlm.detokenizer.incremental import IncrementalDetokenizer, TextDelta
from meshlm.detokenizer.metrics import DetokenizerMetrics
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

logger = logging.getLogger(__name__)

Output: TypeAlias = detokenizer_pb2.DetokenizerOutput


@dataclass(eq=False)
class Subscription:
    """One Subscribe stream: a queue of outputs; None in the queue ends the stream."""

    origin: str
    queue: asyncio.Queue[Output | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def close(self) -> None:
        self.queue.put_nowait(None)

    def take_pending(self) -> list[Output]:
        """Remove and return the outputs not yet sent (the end marker is dropped)."""
        items = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None:
                items.append(item)
        return items


def _rids(msg: Output) -> list[str]:
    if msg.HasField("strs"):
        return [d.rid for d in msg.strs.deltas]
    return [r.rid for r in msg.embeddings.results]


class DetokenizerManager:
    """Decode states, subscribers by origin, held outputs, spans and metrics."""

    def __init__(
        self,
        decoder: TextDecoder,
        *,
        max_states: int = 65536,
        undelivered_hold_s: float = 10.0,
        metrics: DetokenizerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decoder = decoder
        self.detokenizer = IncrementalDetokenizer(decoder, max_states, on_evict=self._end_span)
        self.undelivered_hold_s = undelivered_hold_s
        self.metrics = metrics
        self._clock = clock
        self._subs: dict[str, Subscription] = {}
        self._held: dict[str, deque[tuple[float, Output]]] = {}
        self._spans: dict[str, Span] = {}
        self.closing = False

    # ---- inputs from schedulers -------------------------------------------------------------
    def handle_tokens(self, batch: scheduler_pb2.BatchTokenIDOut) -> None:
        """Decode one step and deliver its text, one BatchStrOut per origin."""
        results = self.detokenizer.step([token_delta(d) for d in batch.deltas])
        self._trace(batch, results)
        for origin, out in str_outputs(batch, results, self.decoder).items():
            self.deliver(origin, Output(strs=out))
        if self.metrics is not None:
            self.metrics.batches_total.inc()
            self.metrics.num_active_requests.set(len(self.detokenizer))

    def handle_embeddings(self, batch: scheduler_pb2.BatchEmbeddingOut) -> None:
        """Embeddings pass through, split by origin."""
        for origin, out in split_embeddings(batch).items():
            self.deliver(origin, Output(embeddings=out))

    # ---- delivery ---------------------------------------------------------------------------
    def deliver(self, origin: str, msg: Output) -> None:
        sub = self._subs.get(origin)
        if sub is not None:
            sub.queue.put_nowait(msg)
        else:
            self._held.setdefault(origin, deque()).append((self._clock() + self.undelivered_hold_s, msg))

    def subscribe(self, origin: str) -> Subscription:
        """Register the origin's subscriber; it first receives what was held or pending for it."""
        self.sweep()
        sub = Subscription(origin)
        old = self._subs.get(origin)
        if old is not None:
            for msg in old.take_pending():
                sub.queue.put_nowait(msg)
            old.close()
            logger.info("origin %s subscribed again; the previous stream ends", origin)
        for _, msg in self._held.pop(origin, ()):
            sub.queue.put_nowait(msg)
        self._subs[origin] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Remove a subscriber (if still current); what it had not sent is held again."""
        if self._subs.get(sub.origin) is not sub:
            return
        del self._subs[sub.origin]
        pending = sub.take_pending()
        if pending:
            deadline = self._clock() + self.undelivered_hold_s
            held = self._held.setdefault(sub.origin, deque())
            held.extendleft((deadline, msg) for msg in reversed(pending))

    async def stream(self, origin: str) -> AsyncGenerator[Output, None]:
        """The outputs of one origin until the subscription ends (replaced, or drain)."""
        sub = self.subscribe(origin)
        try:
            while True:
                msg = await sub.queue.get()
                if msg is None:
                    return
                yield msg
        finally:
            self.unsubscribe(sub)
            sub.done.set()

    def has_subscriber(self, origin: str) -> bool:
        return origin in self._subs

    def sweep(self) -> int:
        """Drop held outputs past their deadline (logged); returns how many were dropped."""
        now = self._clock()
        dropped = 0
        for origin in list(self._held):
            held = self._held[origin]
            rids: list[str] = []
            while held and held[0][0] <= now:
                rids += _rids(held.popleft()[1])
                dropped += 1
            if rids:
                logger.warning(
                    "dropped %d undelivered output(s) for origin %s (no subscriber for %.1fs): rids %s",
                    len(rids),
                    origin,
                    self.undelivered_hold_s,
                    ",".join(dict.fromkeys(rids)),
                )
            if not held:
                del self._held[origin]
        return dropped

    async def run_sweeper(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    async def drain(self) -> None:
        """End every Subscribe stream after what is queued for it, and wait until they are sent.
        Outputs held for absent origins are dropped (logged)."""
        self.closing = True
        subs = list(self._subs.values())
        for sub in subs:
            sub.close()
        await asyncio.gather(*(sub.done.wait() for sub in subs))
        for origin, held in self._held.items():
            rids = [rid for _, msg in held for rid in _rids(msg)]
            logger.warning("drain: dropped %d held output(s) for origin %s: rids %s", len(held), origin, rids)
        self._held.clear()
        for rid in list(self._spans):
            self._end_span(rid)

    # ---- tracing ----------------------------------------------------------------------------
    def _trace(self, batch: scheduler_pb2.BatchTokenIDOut, results: Sequence[TextDelta | None]) -> None:
        for delta, r in zip(batch.deltas, results, strict=True):
            if r is None:
                continue
            if r.started:
                self._end_span(r.rid)
                if delta.trace.traceparent:
                    self._spans[r.rid] = telemetry.start_span(
                        "detokenize",
                        delta.trace.traceparent,
                        delta.trace.tracestate,
                        attributes={"meshlm.rid": r.rid, "meshlm.origin": delta.origin},
                    )
            if r.finished:
                self._end_span(r.rid, r, common_pb2.FinishType.Name(delta.finish_reason.type))

    def _end_span(
        self,
        rid: str,
        result: TextDelta | None = None,
        finish_type: str | None = None,
    ) -> None:
        span = self._spans.pop(rid, None)
        if span is None:
            return
        if result is not None and result.error is not None:
            span.set_status(Status(StatusCode.ERROR, result.error))
        elif finish_type is not None:
            span.set_attribute("meshlm.finish_type", finish_type)
        if result is not None:
            span.set_attribute("meshlm.output_tokens", result.token_offset + len(result.ids))
        span.end()
