"""Per-request and per-call state of the TokenizerManager, and reading one request's entry of
a BatchStrOut into a de-duplicated delta (docs/ring.md: a tokenizer drops or clips what it has).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Optional

import grpc
from meshlm.common.errors import ServiceError, grpc_code_for_http
from meshlm.tokenizer.request import DeltaTracker
from meshlm.v1 import common_pb2, detokenizer_pb2

ABORT = common_pb2.FINISH_TYPE_ABORT
UNSPECIFIED = common_pb2.FINISH_TYPE_UNSPECIFIED
INPUT_LP = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
OUTPUT_LP = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def error_from_finish(rid: str, reason: common_pb2.FinishReason) -> ServiceError:
    """The gRPC error of an ABORT finish (status 0 = aborted on request: CANCELLED)."""
    code = grpc.StatusCode.CANCELLED if reason.status_code == 0 else grpc_code_for_http(reason.status_code)
    return ServiceError(code, f"request {rid} aborted: {reason.message or 'no reason given'}")


def strip_logprob_text(lp: common_pb2.LogprobDelta) -> None:
    """Drop TokenLogprob.text (the ring fills it for every logprob request)."""
    for name in ("input_token_logprobs", "output_token_logprobs"):
        for entry in getattr(lp, name):
            entry.text = ""
    for name in ("input_top_logprobs", "input_token_ids_logprobs", "output_top_logprobs",
                 "output_token_ids_logprobs"):
        for top in getattr(lp, name):
            for entry in top.entries:
                entry.text = ""


@dataclass
class Delta:
    text: str
    ids: list[int]
    logprobs: Optional[common_pb2.LogprobDelta]
    finish: Optional[common_pb2.FinishReason]


class Call:
    """One RPC (Generate or Embed): its requests and the queue their events arrive on.
    Events: ("delta", state, Delta) | ("embedding", state, (values, finish)) |
    ("error", state, ServiceError)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.states: list[ReqState] = []
        self.started = time.monotonic()


class ReqState:
    """One request on the wire: one output of a Generate, a warm-up, or one Embed prompt."""

    def __init__(self, call: Call, index: int, public_rid: str, req: Any, conn: Any,
                 kind: str = "generate") -> None:
        self.call = call
        self.index = index
        self.public_rid = public_rid  # MetaInfo.id
        self.wire_rid = public_rid  # what the scheduler knows (`<rid>_retry` after a retry)
        self.req = req  # TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
        self.conn = conn  # SchedulerConnection
        self.kind = kind  # generate | warmup | embed
        self.tracker = DeltaTracker()
        self.produced = False
        self.retried = False
        self.finished = False
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None
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


def read_str_out(state: ReqState, batch: detokenizer_pb2.BatchStrOut, i: int) -> Optional[Delta]:
    """Entry i of `batch` for `state`, minus what the state already has; None when nothing is
    new (a resend). Updates the state's counters (prompt/completion/cached tokens, retractions)."""
    t = state.tracker

    def at(values: Any, default: Any) -> Any:
        return values[i] if i < len(values) else default

    text = t.clip_text(at(batch.output_strs, ""), at(batch.text_offsets, t.chars))
    raw_ids = batch.output_ids[i].ids if i < len(batch.output_ids) else []
    ids, skipped = t.clip_ids(raw_ids, at(batch.token_offsets, t.ids))
    logprobs = None
    if i < len(batch.logprobs) and batch.logprobs[i].ByteSize():
        logprobs = common_pb2.LogprobDelta()
        logprobs.CopyFrom(batch.logprobs[i])
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
    finish = None
    if i < len(batch.finished_reasons) and batch.finished_reasons[i].type != UNSPECIFIED:
        finish = batch.finished_reasons[i]
    state.prompt_tokens = at(batch.prompt_tokens, state.prompt_tokens)
    state.completion_tokens = at(batch.completion_tokens, state.completion_tokens)
    state.cached_tokens = at(batch.cached_tokens, state.cached_tokens)
    state.retractions = at(batch.retraction_counts, state.retractions)
    if not text and not ids and finish is None and logprobs is None:
        return None
    if text or ids:
        state.produced = True
    return Delta(text, ids, logprobs, finish)
