"""Protobuf <-> domain conversion for the scheduler service (the only place both meet).

Inputs: meshlm.v1 SchedulerInput payloads -> io_struct dataclasses (+ SamplingParams, where an
unset optional field means SGLang's default). Outputs: io_struct BatchTokenIDOut /
BatchEmbeddingOut / control replies -> meshlm.v1 messages. Per-request ring data the engine does
not know (origin, decode seed, token offset, trace) is passed in by the caller (the tracker).

The reverse directions exist too (tests, and tools that drive a scheduler directly).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    CloseSessionOutput,
    CloseSessionReq,
    FlushCacheOutput,
    LoadReport,
    OpenSessionOutput,
    OpenSessionReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TopLogprobs,
)
from meshlm.scheduler.sampling.sampling_params import SamplingParams
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

# ---- sampling params ------------------------------------------------------------------------
_OPTIONAL_SCALARS = (
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n",
    "sampling_seed", "stream_interval", "json_schema", "regex", "ebnf",
)
_FLOATS = frozenset({
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
})
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
    )


def generate_req_to_proto(
    req: TokenizedGenerateReqInput, origin: str = "", trace: Optional[common_pb2.TraceContext] = None
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


# ---- finish reasons -------------------------------------------------------------------------
_ERR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 499: "Aborted", 503: "ServiceUnavailableError"}


def finish_reason_to_proto(reason: Optional[dict[str, Any]]) -> common_pb2.FinishReason:
    """SGLang's finish_reason dict -> FinishReason (type UNSPECIFIED = not finished)."""
    pb = common_pb2.FinishReason()
    if reason is None:
        return pb
    kind = reason.get("type")
    if kind == "stop":
        pb.type = common_pb2.FINISH_TYPE_STOP
        matched = reason.get("matched")
        if isinstance(matched, str):
            pb.matched_str = matched
        elif isinstance(matched, int) and not isinstance(matched, bool):
            pb.matched_token = matched
    elif kind == "length":
        pb.type = common_pb2.FINISH_TYPE_LENGTH
        pb.length = int(reason.get("length", 0))
    else:
        pb.type = common_pb2.FINISH_TYPE_ABORT
        pb.message = str(reason.get("message", ""))
        pb.status_code = int(reason.get("status_code", 500))
    return pb


def finish_reason_from_proto(pb: common_pb2.FinishReason) -> Optional[dict[str, Any]]:
    if pb.type == common_pb2.FINISH_TYPE_STOP:
        which = pb.WhichOneof("matched")
        return {"type": "stop", "matched": getattr(pb, which) if which else None}
    if pb.type == common_pb2.FINISH_TYPE_LENGTH:
        return {"type": "length", "length": pb.length}
    if pb.type == common_pb2.FINISH_TYPE_ABORT:
        return {
            "type": "abort", "message": pb.message, "status_code": pb.status_code,
            "err_type": _ERR_TYPES.get(pb.status_code, "InternalServerError"),
        }
    return None


def abort_reason(message: str, status_code: int) -> common_pb2.FinishReason:
    return common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_ABORT, message=message, status_code=status_code)


# ---- logprobs -------------------------------------------------------------------------------
def _token(lp: Optional[float], token_id: int) -> common_pb2.TokenLogprob:
    if lp is None:  # the first prompt token has no logprob
        return common_pb2.TokenLogprob(token_id=token_id, has_logprob=False)
    return common_pb2.TokenLogprob(logprob=lp, token_id=token_id, has_logprob=True)


def _tops(rows: Sequence[TopLogprobs]) -> list[common_pb2.TopLogprobs]:
    return [
        common_pb2.TopLogprobs(entries=[_token(lp, tid) for lp, tid in (row or ())]) for row in rows
    ]


def logprob_delta_to_proto(out: BatchTokenIDOut, i: int) -> common_pb2.LogprobDelta:
    """Request i's logprob delta (empty message when it asked for none)."""
    pb = common_pb2.LogprobDelta()
    if i >= len(out.output_token_logprobs):
        return pb
    pb.input_token_logprobs.extend(
        _token(lp, tid) for lp, tid in zip(out.input_token_logprobs[i], out.input_token_ids[i])
    )
    pb.input_top_logprobs.extend(_tops(out.input_top_logprobs[i]))
    pb.input_token_ids_logprobs.extend(_tops(out.input_token_ids_logprobs[i]))
    pb.output_token_logprobs.extend(
        _token(lp, tid) for lp, tid in zip(out.output_token_logprobs[i], out.output_ids[i])
    )
    pb.output_top_logprobs.extend(_tops(out.output_top_logprobs[i]))
    pb.output_token_ids_logprobs.extend(_tops(out.output_token_ids_logprobs[i]))
    return pb


def _untops(rows: Sequence[common_pb2.TopLogprobs]) -> list[TopLogprobs]:
    return [[(e.logprob, e.token_id) for e in row.entries] for row in rows]


def append_logprobs_from_proto(out: BatchTokenIDOut, pb: common_pb2.LogprobDelta) -> None:
    out.input_token_logprobs.append([t.logprob if t.has_logprob else None for t in pb.input_token_logprobs])
    out.input_token_ids.append([t.token_id for t in pb.input_token_logprobs])
    out.input_top_logprobs.append(_untops(pb.input_top_logprobs))
    out.input_token_ids_logprobs.append(_untops(pb.input_token_ids_logprobs))
    out.output_token_logprobs.append([t.logprob for t in pb.output_token_logprobs])
    out.output_top_logprobs.append(_untops(pb.output_top_logprobs))
    out.output_token_ids_logprobs.append(_untops(pb.output_token_ids_logprobs))


# ---- outputs --------------------------------------------------------------------------------
def decode_seed(
    prompt_ids: Sequence[int], sp: SamplingParams, want_logprob_text: bool = False
) -> scheduler_pb2.DecodeSeed:
    """The detokenizer's per-request parameters: prompt tail (<= 5 ids) and text flags."""
    return scheduler_pb2.DecodeSeed(
        present=True,
        prompt_tail_ids=list(prompt_ids[-5:]),
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        no_stop_trim=sp.no_stop_trim,
        want_logprob_text=want_logprob_text,
    )


def batch_token_id_out_to_proto(
    out: BatchTokenIDOut,
    *,
    scheduler_id: str,
    indices: Sequence[int],
    origins: Sequence[str],
    seeds: Sequence[Optional[scheduler_pb2.DecodeSeed]],
    token_offsets: Sequence[int],
    traces: Sequence[Optional[common_pb2.TraceContext]],
) -> scheduler_pb2.BatchTokenIDOut:
    """Requests `indices` of a domain BatchTokenIDOut with their ring data (parallel to
    indices; a None seed / trace is sent as an empty message)."""
    pb = scheduler_pb2.BatchTokenIDOut(scheduler_id=scheduler_id)
    for k, i in enumerate(indices):
        pb.rids.append(out.rids[i])
        pb.origins.append(origins[k])
        pb.finished_reasons.append(finish_reason_to_proto(out.finished_reasons[i]))
        pb.output_ids.append(scheduler_pb2.TokenIds(ids=out.output_ids[i]))
        pb.prompt_tokens.append(out.prompt_tokens[i])
        pb.completion_tokens.append(out.completion_tokens[i])
        pb.cached_tokens.append(out.cached_tokens[i])
        pb.seeds.append(seeds[k] or scheduler_pb2.DecodeSeed())
        pb.logprobs.append(logprob_delta_to_proto(out, i))
        pb.traces.append(traces[k] or common_pb2.TraceContext())
        pb.retraction_counts.append(out.retraction_counts[i] if i < len(out.retraction_counts) else 0)
        pb.token_offsets.append(token_offsets[k])
    return pb


def batch_token_id_out_from_proto(pb: scheduler_pb2.BatchTokenIDOut) -> BatchTokenIDOut:
    """The domain view of a wire batch (ring data — origins, seeds, offsets, traces — dropped)."""
    out = BatchTokenIDOut()
    for i, rid in enumerate(pb.rids):
        out.rids.append(rid)
        out.finished_reasons.append(finish_reason_from_proto(pb.finished_reasons[i]))
        out.output_ids.append(list(pb.output_ids[i].ids))
        out.prompt_tokens.append(pb.prompt_tokens[i])
        out.completion_tokens.append(pb.completion_tokens[i])
        out.cached_tokens.append(pb.cached_tokens[i])
        out.retraction_counts.append(pb.retraction_counts[i])
        append_logprobs_from_proto(out, pb.logprobs[i])
    return out


def batch_embedding_out_to_proto(
    out: BatchEmbeddingOut,
    *,
    scheduler_id: str,
    indices: Sequence[int],
    origins: Sequence[str],
    traces: Sequence[Optional[common_pb2.TraceContext]],
) -> scheduler_pb2.BatchEmbeddingOut:
    pb = scheduler_pb2.BatchEmbeddingOut(scheduler_id=scheduler_id)
    for k, i in enumerate(indices):
        pb.rids.append(out.rids[i])
        pb.origins.append(origins[k])
        pb.embeddings.append(scheduler_pb2.Embedding(values=out.embeddings[i] or []))
        pb.prompt_tokens.append(out.prompt_tokens[i])
        pb.finished_reasons.append(finish_reason_to_proto(out.finished_reasons[i]))
        pb.traces.append(traces[k] or common_pb2.TraceContext())
    return pb


def tokens_input(pb: scheduler_pb2.BatchTokenIDOut) -> detokenizer_pb2.DetokenizerInput:
    return detokenizer_pb2.DetokenizerInput(tokens=pb)


def embeddings_input(pb: scheduler_pb2.BatchEmbeddingOut) -> detokenizer_pb2.DetokenizerInput:
    return detokenizer_pb2.DetokenizerInput(embeddings=pb)


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
    return scheduler_pb2.SchedulerOutput(
        error=scheduler_pb2.RequestError(rid=rid, reason=abort_reason(message, status_code))
    )
