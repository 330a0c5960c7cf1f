"""Per-request and per-call state of the TokenizerManager, the typed events a call's queue
carries, and reading one request's TextDelta into a de-duplicated delta (docs/ring.md: a
tokenizer drops or clips what it has).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from meshlm.common.deadline import WaitBound
from meshlm.common.errors import ServiceError
from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.tokenizer.request import DeltaTracker
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, tokenizer_pb2

INPUT_LP = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
OUTPUT_LP = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def error_from_finish(rid: str, reason: FinishReason) -> ServiceError:
    """The gRPC error of an ABORT finish (FinishReason.grpc_code decides the code)."""
    return ServiceError(reason.grpc_code, f"request {rid} aborted: {reason.message or 'no reason given'}")


def error_reason(error: scheduler_pb2.RequestError) -> FinishReason:
    """The ABORT a scheduler's RequestError carries (one without a finish type is a 500)."""
    reason = FinishReason.from_proto(error.reason)
    if reason is None or not reason.is_abort:
        return FinishReason.aborted(error.reason.message, AbortStatus.INTERNAL)
    return reason


def strip_logprob_text(lp: common_pb2.LogprobDelta) -> None:
    """Drop TokenLogprob.text (the ring fills it for every logprob request)."""
    for name in ("input_token_logprobs", "output_token_logprobs"):
        for entry in getattr(lp, name):
            entry.text = ""
    for name in ("input_top_logprobs", "input_token_ids_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        for top in getattr(lp, name):
            for entry in top.entries:
                entry.text = ""


class Received:
    """The output ids (and, for a logprob request, their output logprobs) one request delivered
    so far, in order: what it resumes with if it migrates (migration.py)."""

    __slots__ = ("ids", "logprobs")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs = common_pb2.LogprobDelta()

    def record(self, ids: list[int], logprobs: common_pb2.LogprobDelta | None, want_logprobs: bool) -> None:
        """A de-duplicated delta's new ids and output logprobs (copied: the caller may edit its own)."""
        self.ids.extend(ids)
        if want_logprobs and logprobs is not None:
            for name in OUTPUT_LP:
                getattr(self.logprobs, name).extend(getattr(logprobs, name))

    def logprobs_complete(self) -> bool:
        return len(self.logprobs.output_token_logprobs) == len(self.ids)


class ReqKind(enum.Enum):
    GENERATE = "generate"  # one output of a Generate
    WARMUP = "warmup"  # the max_new_tokens=0 prefill before n>1 samples
    EMBED = "embed"  # one prompt of an Embed


@dataclass
class Delta:
    """What is new for a request (after de-duplication); finish set on its last delta."""

    text: str
    ids: list[int]
    logprobs: common_pb2.LogprobDelta | None
    finish: FinishReason | None


@dataclass(frozen=True)
class DeltaEvent:
    state: ReqState
    delta: Delta


@dataclass(frozen=True)
class EmbeddingEvent:
    """An Embed prompt's result: its values, or an ABORT finish (then no values)."""

    state: ReqState
    values: list[float]
    finish: FinishReason | None


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed outside the ring (lost scheduler, shutdown)."""

    state: ReqState
    error: ServiceError


Event = DeltaEvent | EmbeddingEvent | ErrorEvent


# What one queued event costs beyond its payload (the GenerateResponse it becomes: meta_info, index).
EVENT_OVERHEAD_BYTES = 64


def event_nbytes(event: Event) -> int:
    """The approximate size of what an event becomes on the caller's stream."""
    if isinstance(event, DeltaEvent):
        d = event.delta
        lp = d.logprobs.ByteSize() if d.logprobs is not None else 0
        return EVENT_OVERHEAD_BYTES + len(d.text.encode()) + 4 * len(d.ids) + lp
    return EVENT_OVERHEAD_BYTES


class BacklogQueue(asyncio.Queue["Event"]):
    """A call's event queue that knows the bytes it holds (`nbytes`): what arrived for the call and
    its consumer (the RPC handler, blocked while its caller does not read) has not taken yet."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self._sizes: collections.deque[int] = collections.deque()  # one per queued event, FIFO

    def _put(self, item: Event) -> None:
        size = event_nbytes(item)
        self._sizes.append(size)
        self.nbytes += size
        super()._put(item)

    def _get(self) -> Event:
        item: Event = super()._get()
        self.nbytes -= self._sizes.popleft()
        return item

    def drop_all(self) -> int:
        """Empty the queue (a call failed for its backlog); the number of events dropped."""
        dropped = 0
        while not self.empty():
            self.get_nowait()
            dropped += 1
        return dropped


# A streaming call's delivery of a request's unfinished delta, made by the callback that read it
# (InFlight.on_batch_str_out) instead of through the call's queue. Must not raise or await.
DirectDelivery = Callable[["ReqState", Delta], None]


class Call:
    """One RPC (Generate or Embed): its requests and the queue their events arrive on. Invariant:
    queue.nbytes is the size of the undelivered events; InFlight fails the call when it passes
    max_stream_backlog_bytes (a caller that does not read its stream).

    With `direct` set (a streaming Generate whose caller takes responses as they come, see
    TokenizerManager.generate's sink) a request's unfinished deltas go to it and only its last
    delta, and errors, to the queue: the last delta of a request is read after all its others, so
    its responses stay in order."""

    def __init__(self, rid: str, request_timeout_s: float) -> None:
        self.rid = rid
        self.queue: BacklogQueue = BacklogQueue()
        self.states: list[ReqState] = []
        self.started = time.monotonic()
        self.bound = WaitBound(request_timeout_s)  # each wait for an event (InFlight.next_event)
        self.direct: DirectDelivery | None = None


class ReqState:
    """One request on the wire: one output of a Generate, a warm-up, or one Embed prompt."""

    def __init__(
        self, call: Call, index: int, public_rid: str, req: Any, conn: Any, kind: ReqKind = ReqKind.GENERATE
    ) -> None:
        self.call = call
        self.index = index
        self.public_rid = public_rid  # MetaInfo.id
        self.wire_rid = public_rid  # what the scheduler knows (`<rid>_retry`, `<rid>_m<k>` after a move)
        self.req = req  # TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
        self.conn = conn  # SchedulerConnection
        self.kind = kind
        self.tracker = DeltaTracker()
        self.produced = False
        self.retried = False
        self.migrations = 0
        self.received = Received()
        self.finished = False
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.retractions = 0
        # Non-stream accumulation.
        self.text_parts: list[str] = []
        self.all_ids: list[int] = []
        self.logprobs = common_pb2.LogprobDelta()

    @property
    def session_id(self) -> str:
        return getattr(self.req, "session_id", "")


def read_text_delta(state: ReqState, d: detokenizer_pb2.TextDelta) -> Delta | None:
    """`d` minus what the state already has; None when nothing is new (a resend). Updates the
    state's counters (prompt/completion/cached tokens, retractions)."""
    t = state.tracker
    text = t.clip_text(d.text, d.text_offset)
    ids, skipped = t.clip_ids(d.output_ids, d.token_offset)
    logprobs = None
    if d.logprobs.ByteSize():
        logprobs = common_pb2.LogprobDelta()
        logprobs.CopyFrom(d.logprobs)
        if skipped:  # output logprobs follow the output ids
            for name in OUTPUT_LP:
                del getattr(logprobs, name)[:skipped]
        if t.input_logprobs_seen:  # prompt logprobs come once
            for name in INPUT_LP:
                logprobs.ClearField(name)
        elif any(len(getattr(logprobs, n)) for n in INPUT_LP):
            t.input_logprobs_seen = True
        if not logprobs.ByteSize():
            logprobs = None
    finish = FinishReason.from_proto(d.finish_reason)
    state.prompt_tokens = d.prompt_tokens
    state.completion_tokens = d.completion_tokens
    state.cached_tokens = d.cached_tokens
    state.retractions = d.retraction_count
    if not text and not ids and finish is None and logprobs is None:
        return None
    if text or ids:
        state.produced = True
    return Delta(text, ids, logprobs, finish)


def response_of(
    state: ReqState,
    text: str,
    ids: list[int],
    logprobs: common_pb2.LogprobDelta | None,
    finish: FinishReason | None,
) -> tokenizer_pb2.GenerateResponse:
    """A GenerateResponse of one output: a delta (stream) or the whole output (non-stream)."""
    meta = tokenizer_pb2.MetaInfo(
        id=state.public_rid,
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        cached_tokens=state.cached_tokens,
        retractions=state.retractions,
    )
    if logprobs is not None and logprobs.ByteSize():
        meta.logprobs.CopyFrom(logprobs)
    if finish is not None:
        meta.finish_reason.CopyFrom(finish.to_proto())
        meta.e2e_latency = time.monotonic() - state.call.started
    return tokenizer_pb2.GenerateResponse(
        index=state.index, text=text, output_ids=ids, meta_info=meta, finished=finish is not None
    )
