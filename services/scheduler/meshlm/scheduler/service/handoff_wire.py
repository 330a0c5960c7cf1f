"""Protobuf <-> domain conversion of a prefilled request (prefill/decode disaggregation).

A PrefilledReq travels as KvChunk messages (the raw KV bytes, in order, each at most
KV_CHUNK_BYTES so no message nears gRPC's size limit) followed by one PrefilledReq message
with the request, its first token, its logprobs and the KV's layout.
"""

from __future__ import annotations

import torch

from meshlm.scheduler.managers.io_struct import LogprobDelta, PrefilledReq
from meshlm.scheduler.service import wire
from meshlm.v1 import common_pb2, scheduler_pb2

KV_CHUNK_BYTES = 2 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def prefilled_to_proto(
    msg: PrefilledReq, origin: str, trace: common_pb2.TraceContext | None
) -> list[scheduler_pb2.SchedulerInput]:
    """The SchedulerInput messages that carry msg: KV chunks, then the request."""
    kv = msg.kv.contiguous()
    raw = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
    rid = msg.req.rid
    out = [
        scheduler_pb2.SchedulerInput(kv_chunk=scheduler_pb2.KvChunk(rid=rid, data=raw[i : i + KV_CHUNK_BYTES]))
        for i in range(0, len(raw), KV_CHUNK_BYTES)
    ]
    pb = scheduler_pb2.PrefilledReq(
        req=wire.generate_req_to_proto(msg.req, origin, trace),
        output_ids=msg.output_ids,
        cached_tokens=msg.cached_tokens,
        kv=scheduler_pb2.KvLayout(shape=list(kv.shape), dtype=str(kv.dtype).removeprefix("torch.")),
    )
    if msg.req.return_logprob:
        start = max(msg.req.logprob_start_len, 0)
        lp = LogprobDelta(
            input_token_logprobs=msg.input_token_logprobs,
            input_token_ids=msg.req.input_ids[start:],
            input_top_logprobs=msg.input_top_logprobs,
            input_token_ids_logprobs=msg.input_token_ids_logprobs,
            output_token_logprobs=msg.output_token_logprobs,
            output_top_logprobs=msg.output_top_logprobs,
            output_token_ids_logprobs=msg.output_token_ids_logprobs,
        )
        pb.logprobs.CopyFrom(wire.logprobs_to_proto(lp, msg.output_ids))
    out.append(scheduler_pb2.SchedulerInput(prefilled=pb))
    return out


def prefilled_from_proto(pb: scheduler_pb2.PrefilledReq, raw: bytes | bytearray) -> PrefilledReq:
    """The domain PrefilledReq; raises ValueError naming the field when the KV bytes do not
    match the layout (the decode scheduler's loop checks the shape against its own pool)."""
    dtype = _DTYPES.get(pb.kv.dtype)
    if dtype is None:
        raise ValueError(f"kv.dtype must be one of {sorted(_DTYPES)}, got {pb.kv.dtype!r}")
    shape = list(pb.kv.shape)
    numel = 1
    for n in shape:
        numel *= n
    want = numel * torch.empty(0, dtype=dtype).element_size()
    if len(raw) != want:
        raise ValueError(f"kv chunks hold {len(raw)} bytes; kv.shape {shape} in {pb.kv.dtype} needs {want}")
    kv = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    lp = wire.logprobs_from_proto(pb.logprobs)
    return PrefilledReq(
        req=wire.generate_req_from_proto(pb.req),
        output_ids=list(pb.output_ids),
        kv=kv,
        cached_tokens=pb.cached_tokens,
        input_token_logprobs=lp.input_token_logprobs,
        input_top_logprobs=lp.input_top_logprobs,
        input_token_ids_logprobs=lp.input_token_ids_logprobs,
        output_token_logprobs=lp.output_token_logprobs,
        output_top_logprobs=lp.output_top_logprobs,
        output_token_ids_logprobs=lp.output_token_ids_logprobs,
    )
