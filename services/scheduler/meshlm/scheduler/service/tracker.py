"""RequestTracker: what the scheduler service remembers per request for the ring.

The engine knows nothing of origins, traces or detokenizers. The service tracks, per live
request: its origin and Connect stream, trace context, decode seed, and everything it emitted so
far as one running-total TokenDelta (all output ids, accumulated logprobs, latest counts and
finish reason) or its EmbeddingOut, so that

  * each outgoing TokenDelta carries its origin, seed (first emission per detokenizer stream),
    token offset and trace; the first emission per detokenizer stream is the running total
    from token offset 0 (a migrated request's first one thus re-sends the outputs it resumed,
    so the detokenizer decodes its text from the start and the tokenizer clips what it has), and
  * after a detokenizer fail-over, a resync can re-send every tracked request from token
    offset 0 with its seed (ring.md). Finished requests stay tracked for `retention_s`.

Both kinds of message are built by wire.token_delta_to_proto / wire.embedding_to_proto, the
step's delta and the resync's running total alike. Owned by the service's asyncio thread (no
locking).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshlm.common.finish import FinishReason
from meshlm.scheduler.managers.io_struct import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    EmbeddingOut,
    ReqTimes,
    TokenDelta,
)
from meshlm.scheduler.service import wire
from meshlm.v1 import common_pb2, scheduler_pb2

FINISHED_RETENTION_S = 30.0


@dataclass
class TrackedRequest:
    rid: str
    origin: str
    conn_id: int
    trace: common_pb2.TraceContext
    seed: scheduler_pb2.DecodeSeed
    is_embedding: bool = False
    # Everything emitted so far: the running total of the request's TokenDeltas (token offset
    # 0), or its embedding. An embedding request rejected by the loop emits a TokenDelta. A
    # migrated request starts with the outputs it resumed (wire.resumed_delta).
    sent: TokenDelta | None = None
    embedding: EmbeddingOut | None = None
    emissions: int = 0  # outputs produced so far
    seeded: bool = False  # seed sent on the current detokenizer stream
    finished_at: float | None = None  # monotonic
    spans_emitted: set[str] = field(default_factory=set)
    # Disaggregation. Prefill side: the decode endpoint the request was handed to, and
    # whether an abort was asked (a handover still in flight is then dropped). Decode side:
    # the request came from a prefill scheduler, which wants handover_done when it ends.
    handed_to: str | None = None
    abort_requested: bool = False
    from_prefill: bool = False

    @property
    def finish(self) -> FinishReason | None:
        if self.embedding is not None:
            return self.embedding.finish_reason
        return self.sent.finish_reason if self.sent is not None else None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def num_output_ids(self) -> int:
        return len(self.sent.output_ids) if self.sent is not None else 0

    @property
    def times(self) -> ReqTimes | None:
        """The engine's phase times (latest seen; None for embeddings)."""
        return self.sent.times if self.sent is not None else None


class RequestTracker:
    def __init__(self, retention_s: float = FINISHED_RETENTION_S) -> None:
        self.retention_s = retention_s
        self._reqs: dict[str, TrackedRequest] = {}

    # ---- bookkeeping --------------------------------------------------------------------
    def add(self, req: TrackedRequest) -> None:
        self._reqs[req.rid] = req

    def get(self, rid: str) -> TrackedRequest | None:
        return self._reqs.get(rid)

    def is_live(self, rid: str) -> bool:
        t = self._reqs.get(rid)
        return t is not None and not t.finished

    def remove(self, rid: str) -> TrackedRequest | None:
        return self._reqs.pop(rid, None)

    def live(self) -> list[TrackedRequest]:
        return [t for t in self._reqs.values() if not t.finished]

    def num_live(self) -> int:
        return sum(not t.finished for t in self._reqs.values())

    def emitted(self) -> list[TrackedRequest]:
        """Requests a detokenizer knows of (they produced at least one output)."""
        return [t for t in self._reqs.values() if t.emissions]

    def num_emitted(self) -> int:
        return sum(bool(t.emissions) for t in self._reqs.values())

    def __len__(self) -> int:
        return len(self._reqs)

    def expire(self, now: float | None = None) -> int:
        """Forget requests finished more than retention_s ago; returns how many."""
        now = time.monotonic() if now is None else now
        old = [r for r, t in self._reqs.items() if t.finished_at is not None and now - t.finished_at > self.retention_s]
        for rid in old:
            del self._reqs[rid]
        return len(old)

    # ---- outputs ------------------------------------------------------------------------
    def token_out(
        self, out: BatchTokenIDOut, scheduler_id: str
    ) -> tuple[scheduler_pb2.BatchTokenIDOut, list[TrackedRequest]]:
        """The wire message for a step's output (untracked rids — already failed — are left
        out) and the tracked requests it holds, in order. Updates each request's state."""
        pb = scheduler_pb2.BatchTokenIDOut(scheduler_id=scheduler_id)
        tracked = []
        now = time.monotonic()
        for delta in out.deltas:
            t = self._reqs.get(delta.rid)
            if t is None or t.finished:
                continue
            if t.emissions == 0 and delta.prompt_tail_ids:
                del t.seed.prompt_tail_ids[:]  # the prompt as the loop built it (sessions)
                t.seed.prompt_tail_ids.extend(delta.prompt_tail_ids)
            offset = t.num_output_ids
            if t.sent is None:
                t.sent = TokenDelta(rid=t.rid)
            t.sent.absorb(delta)
            # Unseeded on this detokenizer stream: the running total from offset 0 with the seed
            # (for a new request that is this delta; a migrated one starts with what it resumed).
            first = not t.seeded
            pb.deltas.append(
                wire.token_delta_to_proto(
                    t.sent if first else delta,
                    origin=t.origin,
                    token_offset=0 if first else offset,
                    seed=t.seed if first else None,
                    trace=t.trace,
                )
            )
            t.seeded = True
            t.emissions += 1
            if t.finished:
                t.finished_at = now
            tracked.append(t)
        return pb, tracked

    def embedding_out(
        self, out: BatchEmbeddingOut, scheduler_id: str
    ) -> tuple[scheduler_pb2.BatchEmbeddingOut, list[TrackedRequest]]:
        pb = scheduler_pb2.BatchEmbeddingOut(scheduler_id=scheduler_id)
        tracked = []
        now = time.monotonic()
        for result in out.results:
            t = self._reqs.get(result.rid)
            if t is None or t.finished:
                continue
            pb.results.append(wire.embedding_to_proto(result, origin=t.origin, trace=t.trace))
            t.emissions += 1
            t.seeded = True
            t.embedding = result
            t.finished_at = now
            tracked.append(t)
        return pb, tracked

    def resync(self, scheduler_id: str) -> list[scheduler_pb2.BatchTokenIDOut | scheduler_pb2.BatchEmbeddingOut]:
        """For a new detokenizer stream: every request that emitted, from token offset 0 with
        its seed, all output ids, its finish reason and accumulated logprobs. Requests that did
        not emit yet will send their seed with their first output."""
        tokens = scheduler_pb2.BatchTokenIDOut(scheduler_id=scheduler_id)
        embeds = scheduler_pb2.BatchEmbeddingOut(scheduler_id=scheduler_id)
        for t in self._reqs.values():
            t.seeded = bool(t.emissions)
            if t.embedding is not None:
                embeds.results.append(wire.embedding_to_proto(t.embedding, origin=t.origin, trace=t.trace))
            elif t.sent is not None and t.emissions:
                tokens.deltas.append(
                    wire.token_delta_to_proto(
                        t.sent,
                        origin=t.origin,
                        token_offset=0,
                        seed=t.seed,
                        trace=t.trace,
                    )
                )
        out: list[scheduler_pb2.BatchTokenIDOut | scheduler_pb2.BatchEmbeddingOut] = []
        if tokens.deltas:
            out.append(tokens)
        if embeds.results:
            out.append(embeds)
        return out
