"""What the sampling tests build: a verified, normalised SamplingParams, a Req around it, and the
SamplingBatchInfo of some requests (vocabulary V)."""

from __future__ import annotations

from typing import Any

from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.sampling import SamplingBatchInfo, SamplingParams

V = 64


def params(vocab: int = V, **kw: Any) -> SamplingParams:
    sp = SamplingParams(**kw)
    sp.verify(vocab)
    sp.normalize(None)
    return sp


def req(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    vocab: int = V,
    **kw: Any,
) -> Req:
    sp = params(vocab, **kw)
    r = Req("r", prompt if prompt is not None else [1, 2, 3], sp, eos_token_ids=eos)
    r.output_ids = list(output or [])
    return r


def info_for(reqs: list[Any], vocab: int = V) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
