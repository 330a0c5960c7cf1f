"""Protobuf <-> domain conversion for the scheduler service (the only place both meet).

Inputs: meshlm.v1 SchedulerInput payloads -> io_struct dataclasses (+ SamplingParams, where an
unset optional field means SGLang's default). Outputs: one io_struct TokenDelta / EmbeddingOut
-> one meshlm.v1 TokenDelta / EmbeddingOut (`token_delta_to_proto`, `embedding_to_proto`: the
only builders of those messages), control replies -> meshlm.v1 messages. Per-request ring data
the engine does not know (origin, decode seed, token offset, trace) is passed in by the caller
(the tracker). Finish reasons convert in meshlm.common.finish.

The reverse directions exist too (tests, and tools that drive a scheduler directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshlm.common.finish import FinishReason
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    CloseSessionOutput,
    CloseSessionReq,
    EmbeddingOut,
    FlushCacheOutput,
    LoadReport,
    LogprobDelta,
    OpenSessionOutput,
    OpenSessionReq,
    ResumedOutput,
    TokenDelta,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TopLogprobs,
)
from meshlm.scheduler.sampling.sampling_params import SamplingParams
from meshlm.v1 import common_pb2, scheduler_pb2

# ---- sampling params ------------------------------------------------------------------------
_OPTIONAL_SCALARS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "stream_interval",
    "json_schema",
    "regex",
    "ebnf",
)
_FLOATS = frozenset(
    {
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    }
)
_DEFAULTS = SamplingParams()


def _from_f32(x: float) -> float:
    """A proto float32 as the decimal the sender most likely wrote (0.7, not 0.699999988)."""
    return float(f"{x:.7g}")


def sampling_params_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SGLang's defaults; empty lists/maps are None (unset)."""
    kw: dict[str, Any] = {}
    for name in _OPTIONAL_SCALARS:
        if pb.HasField(name):
            value = getattr(pb, name)
            kw[name] = _from_f32(value) if name in _FLOATS else value
    if pb.stop:
        kw["stop"] = list(pb.stop)
    if pb.stop_token_ids:
        kw["stop_token_ids"] = list(pb.stop_token_ids)
    if pb.logit_bias:
        kw["logit_bias"] = {int(k): _from_f32(v) for k, v in pb.logit_bias.items()}
    return SamplingParams(**kw)


def sampling_params_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """Only values that differ from the defaults are set (unset = default on the other side)."""
    pb = common_pb2.SamplingParams()
    for name in _OPTIONAL_SCALARS:
        value = getattr(sp, name)
        if value is not None and value != getattr(_DEFAULTS, name):
            setattr(pb, name, value)
    if sp.max_new_tokens is None:
        pb.ClearField("max_new_tokens")  # proto cannot say "no limit"; the default is sent
    if sp.stop is not None:
        pb.stop.extend([sp.stop] if isinstance(sp.stop, str) else list(sp.stop))
    if sp.stop_token_ids:
        pb.stop_token_ids.extend(sp.stop_token_ids)
    for k, v in sp.logit_bias_ids().items():
        pb.logit_bias[k] = v
    return pb


# ---- requests -------------------------------------------------------------------------------
def generate_req_from_proto(pb: scheduler_pb2.TokenizedGenerateReqInput) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=pb.rid,
        input_ids=list(pb.input_ids),
        sampling_params=sampling_params_from_proto(pb.sampling_params),
        input_text=pb.input_text or None,
        return_logprob=pb.return_logprob,
        logprob_start_len=pb.logprob_start_len,
        top_logprobs_num=pb.top_logprobs_num,
        token_ids_logprob=list(pb.token_ids_logprob) if pb.has_token_ids_logprob else None,
        stream=pb.stream,
        session_id=pb.session_id or None,
        session_rid=pb.session_rid or None,
        resumed=resumed_from_proto(pb.resumed, pb.return_logprob) if pb.HasField("resumed") else None,
    )


def resumed_from_proto(pb: scheduler_pb2.ResumedOutput, return_logprob: bool) -> ResumedOutput:
    """A migrated request's earlier outputs (their logprobs only when the request wants logprobs)."""
    return ResumedOutput(
        output_ids=list(pb.output_ids),
        logprobs=logprobs_from_proto(pb.logprobs) if return_logprob else None,
        cached_tokens=pb.cached_tokens,
    )


def resumed_to_proto(resumed: ResumedOutput) -> scheduler_pb2.ResumedOutput:
    pb = scheduler_pb2.ResumedOutput(output_ids=resumed.output_ids, cached_tokens=resumed.cached_tokens)
    if resumed.logprobs is not None:
        pb.logprobs.CopyFrom(logprobs_to_proto(resumed.logprobs, resumed.output_ids))
    return pb


def generate_req_to_proto(
    req: TokenizedGenerateReqInput, origin: str = "", trace: common_pb2.TraceContext | None = None
) -> scheduler_pb2.TokenizedGenerateReqInput:
    pb = scheduler_pb2.TokenizedGenerateReqInput(
        rid=req.rid,
        origin=origin,
        input_text=req.input_text or "",
        input_ids=req.input_ids,
        sampling_params=sampling_params_to_proto(req.sampling_params),
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len,
        top_logprobs_num=req.top_logprobs_num,
        token_ids_logprob=req.token_ids_logprob or [],
        has_token_ids_logprob=req.token_ids_logprob is not None,
        stream=req.stream,
        session_id=req.session_id or "",
        session_rid=req.session_rid or "",
    )
    if req.resumed is not None:
        pb.resumed.CopyFrom(resumed_to_proto(req.resumed))
    if trace is not None:
        pb.trace.CopyFrom(trace)
    return pb


def embedding_req_from_proto(pb: scheduler_pb2.TokenizedEmbeddingReqInput) -> TokenizedEmbeddingReqInput:
    return TokenizedEmbeddingReqInput(rid=pb.rid, input_ids=list(pb.input_ids), input_text=pb.input_text or None)


def abort_from_proto(pb: scheduler_pb2.AbortReq) -> AbortReq:
    return AbortReq(rid=pb.rid, abort_all=pb.abort_all, message=pb.message or AbortReq.message)


def open_session_from_proto(pb: scheduler_pb2.OpenSessionReq, call_id: int = 0) -> OpenSessionReq:
    return OpenSessionReq(pb.capacity_of_str_len, pb.session_id or None, call_id)


def close_session_from_proto(pb: scheduler_pb2.CloseSessionReq, call_id: int = 0) -> CloseSessionReq:
    return CloseSessionReq(pb.session_id, call_id)


# ---- logprobs -------------------------------------------------------------------------------
def _token(lp: float | None, token_id: int) -> common_pb2.TokenLogprob:
    if lp is None:  # the first prompt token has no logprob
        return common_pb2.TokenLogprob(token_id=token_id, has_logprob=False)
    return common_pb2.TokenLogprob(logprob=lp, token_id=token_id, has_logprob=True)


def _tops(rows: Sequence[TopLogprobs]) -> list[common_pb2.TopLogprobs]:
    return [common_pb2.TopLogprobs(entries=[_token(lp, tid) for lp, tid in (row or ())]) for row in rows]


def logprobs_to_proto(lp: LogprobDelta, output_ids: Sequence[int]) -> common_pb2.LogprobDelta:
    """A delta's logprobs (output entry k is about output_ids[k])."""
    pb = common_pb2.LogprobDelta()
    pb.input_token_logprobs.extend(_token(x, tid) for x, tid in zip(lp.input_token_logprobs, lp.input_token_ids))
    pb.input_top_logprobs.extend(_tops(lp.input_top_logprobs))
    pb.input_token_ids_logprobs.extend(_tops(lp.input_token_ids_logprobs))
    pb.output_token_logprobs.extend(_token(x, tid) for x, tid in zip(lp.output_token_logprobs, output_ids))
    pb.output_top_logprobs.extend(_tops(lp.output_top_logprobs))
    pb.output_token_ids_logprobs.extend(_tops(lp.output_token_ids_logprobs))
    return pb


def _untops(rows: Sequence[common_pb2.TopLogprobs]) -> list[TopLogprobs]:
    return [[(e.logprob, e.token_id) for e in row.entries] for row in rows]


def logprobs_from_proto(pb: common_pb2.LogprobDelta) -> LogprobDelta:
    return LogprobDelta(
        input_token_logprobs=[t.logprob if t.has_logprob else None for t in pb.input_token_logprobs],
        input_token_ids=[t.token_id for t in pb.input_token_logprobs],
        input_top_logprobs=_untops(pb.input_top_logprobs),
        input_token_ids_logprobs=_untops(pb.input_token_ids_logprobs),
        output_token_logprobs=[t.logprob for t in pb.output_token_logprobs],
        output_top_logprobs=_untops(pb.output_top_logprobs),
        output_token_ids_logprobs=_untops(pb.output_token_ids_logprobs),
    )


# ---- outputs --------------------------------------------------------------------------------
def decode_seed(
    prompt_ids: Sequence[int], sp: SamplingParams, want_logprob_text: bool = False
) -> scheduler_pb2.DecodeSeed:
    """The detokenizer's per-request parameters: prompt tail (<= 5 ids) and text flags."""
    return scheduler_pb2.DecodeSeed(
        prompt_tail_ids=list(prompt_ids[-5:]),
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        no_stop_trim=sp.no_stop_trim,
        want_logprob_text=want_logprob_text,
    )


def token_delta_to_proto(
    delta: TokenDelta,
    *,
    origin: str,
    token_offset: int,
    seed: scheduler_pb2.DecodeSeed | None,
    trace: common_pb2.TraceContext | None,
) -> scheduler_pb2.TokenDelta:
    """One request's wire delta: the engine's delta plus its ring data. Unset: finish_reason
    while running, logprobs when the request asked for none, seed when it is not due."""
    pb = scheduler_pb2.TokenDelta(
        rid=delta.rid,
        origin=origin,
        output_ids=delta.output_ids,
        token_offset=token_offset,
        prompt_tokens=delta.prompt_tokens,
        completion_tokens=delta.completion_tokens,
        cached_tokens=delta.cached_tokens,
        retraction_count=delta.retraction_count,
    )
    if delta.finish_reason is not None:
        pb.finish_reason.CopyFrom(delta.finish_reason.to_proto())
    if delta.logprobs is not None:
        pb.logprobs.CopyFrom(logprobs_to_proto(delta.logprobs, delta.output_ids))
    if seed is not None:
        pb.seed.CopyFrom(seed)
    if trace is not None:
        pb.trace.CopyFrom(trace)
    return pb


def token_delta_from_proto(pb: scheduler_pb2.TokenDelta) -> TokenDelta:
    """The engine's view of a wire delta (ring data — origin, seed, offset, trace — dropped)."""
    return TokenDelta(
        rid=pb.rid,
        output_ids=list(pb.output_ids),
        finish_reason=FinishReason.from_proto(pb.finish_reason),
        prompt_tokens=pb.prompt_tokens,
        completion_tokens=pb.completion_tokens,
        cached_tokens=pb.cached_tokens,
        retraction_count=pb.retraction_count,
        logprobs=logprobs_from_proto(pb.logprobs) if pb.HasField("logprobs") else None,
    )


def resumed_delta(req: TokenizedGenerateReqInput) -> TokenDelta | None:
    """The running total a migrated request starts with (its resumed outputs), None for others."""
    if req.resumed is None:
        return None
    lp = None
    if req.return_logprob:
        src = req.resumed.logprobs or LogprobDelta()
        lp = LogprobDelta(
            output_token_logprobs=list(src.output_token_logprobs),
            output_top_logprobs=list(src.output_top_logprobs),
            output_token_ids_logprobs=list(src.output_token_ids_logprobs),
        )
    return TokenDelta(
        rid=req.rid,
        output_ids=list(req.resumed.output_ids),
        completion_tokens=len(req.resumed.output_ids),
        cached_tokens=req.resumed.cached_tokens,
        logprobs=lp,
    )


def embedding_to_proto(
    out: EmbeddingOut, *, origin: str, trace: common_pb2.TraceContext | None
) -> scheduler_pb2.EmbeddingOut:
    pb = scheduler_pb2.EmbeddingOut(
        rid=out.rid,
        origin=origin,
        embedding=out.embedding,
        prompt_tokens=out.prompt_tokens,
        finish_reason=out.finish_reason.to_proto(),
    )
    if trace is not None:
        pb.trace.CopyFrom(trace)
    return pb


# ---- control replies ------------------------------------------------------------------------
def load_to_proto(report: LoadReport, scheduler_id: str) -> common_pb2.SchedulerLoad:
    return common_pb2.SchedulerLoad(
        scheduler_id=scheduler_id,
        num_running_reqs=report.num_running_reqs,
        num_queue_reqs=report.num_queue_reqs,
        num_used_tokens=report.num_used_tokens,
        max_total_num_tokens=report.max_total_num_tokens,
        token_usage=report.token_usage,
        cache_hit_rate=report.cache_hit_rate,
        max_running_requests=report.max_running_requests,
    )


def flush_cache_output_to_proto(out: FlushCacheOutput) -> scheduler_pb2.FlushCacheOutput:
    return scheduler_pb2.FlushCacheOutput(success=out.success, message=out.message)


def open_session_output_to_proto(out: OpenSessionOutput) -> scheduler_pb2.OpenSessionOutput:
    return scheduler_pb2.OpenSessionOutput(session_id=out.session_id or "", success=out.success, message=out.message)


def control_reply(call_id: int, out: Any, scheduler_id: str) -> scheduler_pb2.SchedulerOutput:
    """The SchedulerOutput answering a control call (call_id is the caller's)."""
    if isinstance(out, FlushCacheOutput):
        return scheduler_pb2.SchedulerOutput(call_id=call_id, flush_cache=flush_cache_output_to_proto(out))
    if isinstance(out, OpenSessionOutput):
        return scheduler_pb2.SchedulerOutput(call_id=call_id, open_session=open_session_output_to_proto(out))
    if isinstance(out, CloseSessionOutput):  # ack=false: no such session
        return scheduler_pb2.SchedulerOutput(call_id=call_id, ack=out.success)
    if isinstance(out, LoadReport):
        return scheduler_pb2.SchedulerOutput(call_id=call_id, load=load_to_proto(out, scheduler_id))
    raise TypeError(f"not a control reply: {type(out).__name__}")


def request_error(rid: str, message: str, status_code: int) -> scheduler_pb2.SchedulerOutput:
    """An early error for one request on its origin's Connect stream."""
    reason = FinishReason.aborted(message, status_code).to_proto()
    return scheduler_pb2.SchedulerOutput(error=scheduler_pb2.RequestError(rid=rid, reason=reason))
