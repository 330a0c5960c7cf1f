"""Wire messages <-> the plain values of `incremental`: BatchTokenIDOut in, one BatchStrOut per
origin out; BatchEmbeddingOut split per origin.

Invariants:
- Parallel lists shorter than `rids` read as their zero values (an absent seed = not present).
- Every list of an outgoing BatchStrOut has one entry per rid (empty messages where the input
  had none), in the order the requests appeared in the step.
- A request the detokenizer cannot continue finishes with FinishReason ABORT, status_code 500,
  and a message naming the request and the cause.
- Logprob entries get their token text only when the request's seed asked for it.
"""

from __future__ import annotations

from typing import Optional, Sequence, TypeVar

from meshlm.detokenizer.decoder import TextDecoder
from meshlm.detokenizer.incremental import Seed, TextDelta, TokenDelta
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

T = TypeVar("T")
INTERNAL_ERROR_STATUS = 500


def _padded(items: Sequence[T], n: int, default: T) -> list[T]:
    """`items` as a list of length n (missing entries read as `default`)."""
    out = list(items[:n])
    if len(out) < n:
        out += [default] * (n - len(out))
    return out


def seed_from_proto(seed: scheduler_pb2.DecodeSeed) -> Optional[Seed]:
    if not seed.present:
        return None
    return Seed(
        prompt_tail_ids=tuple(seed.prompt_tail_ids),
        skip_special_tokens=seed.skip_special_tokens,
        spaces_between_special_tokens=seed.spaces_between_special_tokens,
        no_stop_trim=seed.no_stop_trim,
        want_logprob_text=seed.want_logprob_text,
    )


def token_deltas(batch: scheduler_pb2.BatchTokenIDOut) -> list[TokenDelta]:
    """One TokenDelta per request of the step."""
    n = len(batch.rids)
    output_ids = _padded(batch.output_ids, n, scheduler_pb2.TokenIds())
    offsets = _padded(batch.token_offsets, n, 0)
    seeds = _padded(batch.seeds, n, scheduler_pb2.DecodeSeed())
    reasons = _padded(batch.finished_reasons, n, common_pb2.FinishReason())
    out = []
    for i, rid in enumerate(batch.rids):
        reason = reasons[i]
        finished = reason.type != common_pb2.FINISH_TYPE_UNSPECIFIED
        matched = reason.WhichOneof("matched") if finished else None
        out.append(
            TokenDelta(
                rid,
                list(output_ids[i].ids),
                offsets[i],
                seed_from_proto(seeds[i]),
                finished,
                reason.matched_token if matched == "matched_token" else None,
                reason.matched_str if matched == "matched_str" else None,
            )
        )
    return out


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


def error_reason(message: str) -> common_pb2.FinishReason:
    return common_pb2.FinishReason(
        type=common_pb2.FINISH_TYPE_ABORT, message=message, status_code=INTERNAL_ERROR_STATUS
    )


def str_outputs(
    batch: scheduler_pb2.BatchTokenIDOut,
    results: Sequence[Optional[TextDelta]],
    decoder: TextDecoder,
) -> dict[str, detokenizer_pb2.BatchStrOut]:
    """Group the step's text deltas by origin (dropped requests, None, are left out)."""
    n = len(results)
    groups: dict[str, tuple[list[int], list[TextDelta]]] = {}
    for i, origin in enumerate(_padded(batch.origins, n, "")):
        r = results[i]
        if r is not None:
            idx, rs = groups.setdefault(origin, ([], []))
            idx.append(i)
            rs.append(r)
    if not groups:
        return {}
    reasons = _padded(batch.finished_reasons, n, common_pb2.FinishReason())
    prompt_tokens = _padded(batch.prompt_tokens, n, 0)
    completion_tokens = _padded(batch.completion_tokens, n, 0)
    cached_tokens = _padded(batch.cached_tokens, n, 0)
    retractions = _padded(batch.retraction_counts, n, 0)
    traces = _padded(batch.traces, n, common_pb2.TraceContext())
    logprobs = _padded(batch.logprobs, n, common_pb2.LogprobDelta())
    outs: dict[str, detokenizer_pb2.BatchStrOut] = {}
    for origin, (idx, rs) in groups.items():
        out = outs[origin] = detokenizer_pb2.BatchStrOut()
        out.rids.extend([r.rid for r in rs])
        out.finished_reasons.extend(
            [reasons[i] if r.error is None else error_reason(r.error) for i, r in zip(idx, rs)]
        )
        out.output_strs.extend([r.text for r in rs])
        out.text_offsets.extend([r.text_offset for r in rs])
        out.output_ids.extend([scheduler_pb2.TokenIds(ids=r.ids) for r in rs])
        out.token_offsets.extend([r.token_offset for r in rs])
        out.prompt_tokens.extend([prompt_tokens[i] for i in idx])
        out.completion_tokens.extend([completion_tokens[i] for i in idx])
        out.cached_tokens.extend([cached_tokens[i] for i in idx])
        out.retraction_counts.extend([retractions[i] for i in idx])
        out.traces.extend([traces[i] for i in idx])
        out.logprobs.extend([logprobs[i] for i in idx])
        for r, lp in zip(rs, out.logprobs):
            if r.seed.want_logprob_text:
                fill_logprob_text(lp, decoder)
    return outs


def split_embeddings(
    batch: scheduler_pb2.BatchEmbeddingOut,
) -> dict[str, scheduler_pb2.BatchEmbeddingOut]:
    """The embedding results of each origin (values passed through unchanged)."""
    n = len(batch.rids)
    origins = _padded(batch.origins, n, "")
    if len(set(origins)) <= 1:
        return {origins[0]: batch} if origins else {}
    embeddings = _padded(batch.embeddings, n, scheduler_pb2.Embedding())
    prompt_tokens = _padded(batch.prompt_tokens, n, 0)
    reasons = _padded(batch.finished_reasons, n, common_pb2.FinishReason())
    traces = _padded(batch.traces, n, common_pb2.TraceContext())
    groups: dict[str, list[int]] = {}
    for i, origin in enumerate(origins):
        groups.setdefault(origin, []).append(i)
    outs: dict[str, scheduler_pb2.BatchEmbeddingOut] = {}
    for origin, idx in groups.items():
        outs[origin] = scheduler_pb2.BatchEmbeddingOut(
            scheduler_id=batch.scheduler_id,
            rids=[batch.rids[i] for i in idx],
            origins=[origin] * len(idx),
            embeddings=[embeddings[i] for i in idx],
            prompt_tokens=[prompt_tokens[i] for i in idx],
            finished_reasons=[reasons[i] for i in idx],
            traces=[traces[i] for i in idx],
        )
    return outs
