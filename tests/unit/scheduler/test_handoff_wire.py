"""A prefilled request survives the trip prefill scheduler -> proto -> decode scheduler: KV bytes
(chunked under the size limit, any dtype), first token, logprobs (the first prompt token's None
included); a KV whose bytes do not match its layout is rejected naming the field."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.managers.io_struct import PrefilledReq, TokenizedGenerateReqInput
from meshlm.scheduler.sampling.sampling_params import SamplingParams
from meshlm.scheduler.service.handoff_wire import KV_CHUNK_BYTES, prefilled_from_proto, prefilled_to_proto
from meshlm.v1 import common_pb2


def make(kv: torch.Tensor, logprobs: bool) -> PrefilledReq:
    ids = list(range(10, 10 + kv.shape[2]))
    req = TokenizedGenerateReqInput(
        rid="r1",
        input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=7, temperature=0.5, stop=["x"]),
        return_logprob=logprobs,
        logprob_start_len=0 if logprobs else -1,
        top_logprobs_num=2 if logprobs else 0,
    )
    msg = PrefilledReq(req=req, output_ids=[42], kv=kv, cached_tokens=3)
    if logprobs:
        msg.input_token_logprobs = [None] + [-0.5] * (len(ids) - 1)
        msg.input_top_logprobs = [[]] + [[(-0.125, 5), (-0.375, 6)]] * (len(ids) - 1)
        msg.output_token_logprobs = [-0.25]
        msg.output_top_logprobs = [[(-0.25, 42), (-1.5, 7)]]
    return msg


def roundtrip(msg: PrefilledReq) -> tuple[PrefilledReq, int]:
    pbs = prefilled_to_proto(msg, "tok-0", common_pb2.TraceContext(traceparent="00-ab-cd-01"))
    chunks, last = pbs[:-1], pbs[-1]
    assert all(p.WhichOneof("msg") == "kv_chunk" and len(p.kv_chunk.data) <= KV_CHUNK_BYTES for p in chunks)
    assert last.prefilled.req.origin == "tok-0" and last.prefilled.req.trace.traceparent == "00-ab-cd-01"
    raw = b"".join(p.kv_chunk.data for p in chunks)
    return prefilled_from_proto(last.prefilled, raw), len(chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_and_state_roundtrip(dtype: torch.dtype) -> None:
    kv = torch.randn(3, 2, 5, 2, 4).to(dtype)
    back, _ = roundtrip(make(kv, logprobs=True))
    assert back.kv.dtype == dtype and torch.equal(back.kv, kv)
    assert back.output_ids == [42] and back.cached_tokens == 3
    assert back.req.input_ids == list(range(10, 15))
    assert back.req.sampling_params.max_new_tokens == 7 and back.req.sampling_params.stop == ["x"]
    assert back.input_token_logprobs[0] is None and back.input_token_logprobs[1] == -0.5
    assert back.input_top_logprobs[0] == [] and back.input_top_logprobs[1] == [(-0.125, 5), (-0.375, 6)]
    assert back.output_token_logprobs == [-0.25]
    assert back.output_top_logprobs == [[(-0.25, 42), (-1.5, 7)]]


def test_large_kv_is_split_into_chunks() -> None:
    kv = torch.randn(30, 2, 400, 3, 64)  # ~17.6 MiB of float32, as SmolLM2 for 400 tokens
    back, n_chunks = roundtrip(make(kv, logprobs=False))
    assert n_chunks == -(-kv.numel() * 4 // KV_CHUNK_BYTES)
    assert torch.equal(back.kv, kv)
    assert back.input_token_logprobs == [] and back.output_token_logprobs == []


def test_kv_bytes_must_match_the_layout() -> None:
    pbs = prefilled_to_proto(make(torch.zeros(2, 2, 3, 1, 4), logprobs=False), "o", None)
    with pytest.raises(ValueError, match=r"kv chunks hold 0 bytes; kv.shape \[2, 2, 3, 1, 4\]"):
        prefilled_from_proto(pbs[-1].prefilled, b"")
    pbs[-1].prefilled.kv.dtype = "int8"
    with pytest.raises(ValueError, match="kv.dtype must be one of"):
        prefilled_from_proto(pbs[-1].prefilled, b"")
