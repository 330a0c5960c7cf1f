"""Wire messages <-> the plain values of `incremental`: each TokenDelta of a BatchTokenIDOut in,
one BatchStrOut per origin out (a TextDelta per request); BatchEmbeddingOut split per origin.

Invariants:
- An unset seed is no seed; an unset finish_reason is a running request.
- The TextDeltas of an outgoing BatchStrOut are in the order their requests appeared in the
  step; each copies its TokenDelta's counts, trace and logprobs.
- A request the detokenizer cannot continue finishes with FinishReason ABORT, status_code 500,
  and a message naming the request and the cause.
- Logprob entries get their token text only when the request's seed asked for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.detokenizer import incremental
from meshlm.detokenizer.decoder import TextDecoder
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2


def seed_from_proto(seed: scheduler_pb2.DecodeSeed) -> incremental.Seed:
    return incremental.Seed(
        prompt_tail_ids=tuple(seed.prompt_tail_ids),
        skip_special_tokens=seed.skip_special_tokens,
        spaces_between_special_tokens=seed.spaces_between_special_tokens,
        no_stop_trim=seed.no_stop_trim,
        want_logprob_text=seed.want_logprob_text,
    )


def token_delta(pb: scheduler_pb2.TokenDelta) -> incremental.TokenDelta:
    """A wire delta as the decode state machine's input."""
    reason = FinishReason.from_proto(pb.finish_reason)
    return incremental.TokenDelta(
        pb.rid,
        list(pb.output_ids),
        pb.token_offset,
        seed_from_proto(pb.seed) if pb.HasField("seed") else None,
        reason is not None,
        reason.matched_token if reason is not None else None,
        reason.matched_str if reason is not None else None,
    )


def fill_logprob_text(delta: common_pb2.LogprobDelta, decoder: TextDecoder) -> None:
    """Set `text` of every TokenLogprob in `delta` to its token's text (in place)."""
    entries = list(delta.input_token_logprobs) + list(delta.output_token_logprobs)
    for tops in (
        delta.input_top_logprobs,
        delta.input_token_ids_logprobs,
        delta.output_top_logprobs,
        delta.output_token_ids_logprobs,
    ):
        for top in tops:
            entries.extend(top.entries)
    if not entries:
        return
    for entry, text in zip(entries, decoder.token_texts([e.token_id for e in entries])):
        entry.text = text


def text_delta(
    pb: scheduler_pb2.TokenDelta, result: incremental.TextDelta, decoder: TextDecoder
) -> detokenizer_pb2.TextDelta:
    """The wire text delta of one request: the decoded text and the ids it covers, with the
    TokenDelta's counts, trace and logprobs (an error replaces its finish reason)."""
    out = detokenizer_pb2.TextDelta(
        rid=result.rid,
        text=result.text,
        text_offset=result.text_offset,
        output_ids=result.ids,
        token_offset=result.token_offset,
        prompt_tokens=pb.prompt_tokens,
        completion_tokens=pb.completion_tokens,
        cached_tokens=pb.cached_tokens,
        retraction_count=pb.retraction_count,
    )
    if result.error is not None:
        out.finish_reason.CopyFrom(FinishReason.aborted(result.error, AbortStatus.INTERNAL).to_proto())
    elif pb.HasField("finish_reason"):
        out.finish_reason.CopyFrom(pb.finish_reason)
    if pb.HasField("trace"):
        out.trace.CopyFrom(pb.trace)
    if pb.HasField("logprobs"):
        out.logprobs.CopyFrom(pb.logprobs)
        if result.seed.want_logprob_text:
            fill_logprob_text(out.logprobs, decoder)
    return out


def str_outputs(
    batch: scheduler_pb2.BatchTokenIDOut,
    results: Sequence[incremental.TextDelta | None],
    decoder: TextDecoder,
) -> dict[str, detokenizer_pb2.BatchStrOut]:
    """Group the step's text deltas by origin (dropped requests, None, are left out).
    `results` is aligned with `batch.deltas`."""
    outs: dict[str, detokenizer_pb2.BatchStrOut] = {}
    for pb, result in zip(batch.deltas, results, strict=True):
        if result is not None:
            out = outs.setdefault(pb.origin, detokenizer_pb2.BatchStrOut())
            out.deltas.append(text_delta(pb, result, decoder))
    return outs


def split_embeddings(
    batch: scheduler_pb2.BatchEmbeddingOut,
) -> dict[str, scheduler_pb2.BatchEmbeddingOut]:
    """The embedding results of each origin (values passed through unchanged)."""
    outs: dict[str, scheduler_pb2.BatchEmbeddingOut] = {}
    for result in batch.results:
        out = outs.setdefault(result.origin, scheduler_pb2.BatchEmbeddingOut(scheduler_id=batch.scheduler_id))
        out.results.append(result)
    return outs
