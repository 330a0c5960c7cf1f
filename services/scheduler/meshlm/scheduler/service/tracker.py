"""RequestTracker: what the scheduler service remembers per request for the ring.

The engine knows nothing of origins, traces or detokenizers. The service tracks, per live
request: its origin and Connect stream, trace context, decode seed, every output id so far
(and the accumulated logprobs and finish reason), so that

  * each outgoing BatchTokenIDOut carries origins, seeds (first emission per detokenizer
    stream), token offsets and traces, and
  * after a detokenizer fail-over, a resync can re-send every tracked request from token
    offset 0 with its seed (ring.md). Finished requests stay tracked for `retention_s`.

Owned by the service's asyncio thread (no locking).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from meshlm.scheduler.managers.io_struct import BatchEmbeddingOut, BatchTokenIDOut, ReqTimes
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
    want_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    finish: Optional[common_pb2.FinishReason] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    retraction_count: int = 0
    logprobs: common_pb2.LogprobDelta = field(default_factory=common_pb2.LogprobDelta)
    embedding: Optional[scheduler_pb2.Embedding] = None
    emissions: int = 0  # outputs produced so far
    seeded: bool = False  # seed sent on the current detokenizer stream
    finished_at: Optional[float] = None  # monotonic
    times: Optional[ReqTimes] = None  # the engine's phase times (latest seen)
    spans_emitted: set[str] = field(default_factory=set)
    # Disaggregation. Prefill side: the decode endpoint the request was handed to, and
    # whether an abort was asked (a handover still in flight is then dropped). Decode side:
    # the request came from a prefill scheduler, which wants handover_done when it ends.
    handed_to: Optional[str] = None
    abort_requested: bool = False
    from_prefill: bool = False

    @property
    def finished(self) -> bool:
        return self.finish is not None


class RequestTracker:
    def __init__(self, retention_s: float = FINISHED_RETENTION_S) -> None:
        self.retention_s = retention_s
        self._reqs: dict[str, TrackedRequest] = {}

    # ---- bookkeeping --------------------------------------------------------------------
    def add(self, req: TrackedRequest) -> None:
        self._reqs[req.rid] = req

    def get(self, rid: str) -> Optional[TrackedRequest]:
        return self._reqs.get(rid)

    def is_live(self, rid: str) -> bool:
        t = self._reqs.get(rid)
        return t is not None and not t.finished

    def remove(self, rid: str) -> Optional[TrackedRequest]:
        return self._reqs.pop(rid, None)

    def live(self) -> list[TrackedRequest]:
        return [t for t in self._reqs.values() if not t.finished]

    def num_live(self) -> int:
        return sum(not t.finished for t in self._reqs.values())

    def emitted(self) -> list[TrackedRequest]:
        """Requests a detokenizer knows of (they produced at least one output)."""
        return [t for t in self._reqs.values() if t.emissions]

    def __len__(self) -> int:
        return len(self._reqs)

    def expire(self, now: Optional[float] = None) -> int:
        """Forget requests finished more than retention_s ago; returns how many."""
        now = time.monotonic() if now is None else now
        old = [r for r, t in self._reqs.items() if t.finished_at is not None and now - t.finished_at > self.retention_s]
        for rid in old:
            del self._reqs[rid]
        return len(old)

    # ---- outputs ------------------------------------------------------------------------
    def token_out(self, out: BatchTokenIDOut, scheduler_id: str) -> tuple[scheduler_pb2.BatchTokenIDOut, list[TrackedRequest]]:
        """The wire message for a step's output (untracked rids — already failed — are left
        out) and the tracked requests it holds, in order. Updates each request's state."""
        indices, origins, seeds, offsets, traces, tracked = [], [], [], [], [], []
        for i, rid in enumerate(out.rids):
            t = self._reqs.get(rid)
            if t is None or t.finished:
                continue
            if t.emissions == 0 and i < len(out.prompt_tail_ids) and out.prompt_tail_ids[i]:
                del t.seed.prompt_tail_ids[:]  # the prompt as the loop built it (sessions)
                t.seed.prompt_tail_ids.extend(out.prompt_tail_ids[i])
            indices.append(i)
            origins.append(t.origin)
            seeds.append(None if t.seeded else t.seed)
            t.seeded = True
            offsets.append(len(t.output_ids))
            traces.append(t.trace)
            tracked.append(t)
        pb = wire.batch_token_id_out_to_proto(
            out, scheduler_id=scheduler_id, indices=indices, origins=origins, seeds=seeds,
            token_offsets=offsets, traces=traces,
        )
        now = time.monotonic()
        for k, (i, t) in enumerate(zip(indices, tracked)):
            t.emissions += 1
            t.output_ids.extend(out.output_ids[i])
            t.prompt_tokens = out.prompt_tokens[i]
            t.completion_tokens = out.completion_tokens[i]
            t.cached_tokens = out.cached_tokens[i]
            t.retraction_count = pb.retraction_counts[k]
            if i < len(out.times):
                t.times = out.times[i]
            if t.want_logprobs:
                t.logprobs.MergeFrom(pb.logprobs[k])  # repeated fields concatenate
            if pb.finished_reasons[k].type != common_pb2.FINISH_TYPE_UNSPECIFIED:
                t.finish = pb.finished_reasons[k]
                t.finished_at = now
        return pb, tracked

    def embedding_out(self, out: BatchEmbeddingOut, scheduler_id: str) -> tuple[scheduler_pb2.BatchEmbeddingOut, list[TrackedRequest]]:
        indices = [i for i, rid in enumerate(out.rids) if self.is_live(rid)]
        tracked = [self._reqs[out.rids[i]] for i in indices]
        pb = wire.batch_embedding_out_to_proto(
            out, scheduler_id=scheduler_id, indices=indices,
            origins=[t.origin for t in tracked], traces=[t.trace for t in tracked],
        )
        now = time.monotonic()
        for k, t in enumerate(tracked):
            t.emissions += 1
            t.seeded = True
            t.prompt_tokens = pb.prompt_tokens[k]
            t.embedding = pb.embeddings[k]
            t.finish = pb.finished_reasons[k]
            if t.finish.type == common_pb2.FINISH_TYPE_UNSPECIFIED:
                t.finish.type = common_pb2.FINISH_TYPE_LENGTH
            t.finished_at = now
        return pb, tracked

    def resync(self, scheduler_id: str) -> list[scheduler_pb2.BatchTokenIDOut | scheduler_pb2.BatchEmbeddingOut]:
        """For a new detokenizer stream: every request that emitted, from token offset 0 with
        its seed, all output ids, its finish reason and accumulated logprobs. Requests that did
        not emit yet will send their seed with their first output."""
        tokens = scheduler_pb2.BatchTokenIDOut(scheduler_id=scheduler_id)
        embeds = scheduler_pb2.BatchEmbeddingOut(scheduler_id=scheduler_id)
        for t in self._reqs.values():
            t.seeded = bool(t.emissions)
            if not t.emissions:
                continue
            if t.is_embedding:
                embeds.rids.append(t.rid)
                embeds.origins.append(t.origin)
                embeds.embeddings.append(t.embedding or scheduler_pb2.Embedding())
                embeds.prompt_tokens.append(t.prompt_tokens)
                embeds.finished_reasons.append(t.finish or common_pb2.FinishReason())
                embeds.traces.append(t.trace)
                continue
            tokens.rids.append(t.rid)
            tokens.origins.append(t.origin)
            tokens.finished_reasons.append(t.finish or common_pb2.FinishReason())
            tokens.output_ids.append(scheduler_pb2.TokenIds(ids=t.output_ids))
            tokens.prompt_tokens.append(t.prompt_tokens)
            tokens.completion_tokens.append(t.completion_tokens)
            tokens.cached_tokens.append(t.cached_tokens)
            tokens.seeds.append(t.seed)
            tokens.logprobs.append(t.logprobs)
            tokens.traces.append(t.trace)
            tokens.retraction_counts.append(t.retraction_count)
            tokens.token_offsets.append(0)
        out: list[scheduler_pb2.BatchTokenIDOut | scheduler_pb2.BatchEmbeddingOut] = []
        if tokens.rids:
            out.append(tokens)
        if embeds.rids:
            out.append(embeds)
        return out
