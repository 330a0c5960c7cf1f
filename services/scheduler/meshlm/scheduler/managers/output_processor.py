"""OutputProcessor: turn a finished forward into request state and outgoing deltas (SGLang's
scheduler_output_processor_mixin): append tokens and logprobs, check stop conditions, cache
or hand over KV, and emit one BatchTokenIDOut per step holding a TokenDelta per emitting
request (`stream_output`, also used by every other part to end a request with an error).

KV rule after a step: a finished request's KV goes to the prefix cache (cache_finished_req);
an unfinished one's computed prompt is made shareable (cache_unfinished_req), unless the
prefill role hands it over (PrefillHandoff) or it is a decode step riding in a mixed batch.

Constrained decoding: each appended token advances the request's grammar matcher
(`_advance_grammar`), so the matcher has always accepted exactly output_ids; a grammar that
terminates ends the request with finish reason stop (check_finished).
"""

from __future__ import annotations

import time

import torch

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.scheduler.disaggregation.prefill import PrefillHandoff
from meshlm.scheduler.managers.io_struct import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    EmbeddingOut,
    LogprobDelta,
    TokenDelta,
)
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.tokenizer_protocol import Tokenizer
from meshlm.scheduler.managers.tp_worker import GenerationBatchResult
from meshlm.scheduler.mem_cache.base_prefix_cache import BasePrefixCache
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch
from meshlm.scheduler.sampling.sampler import compute_logprobs

FORCE_STREAM_INTERVAL = 50  # non-streaming requests still emit this often (detokenizer pace)


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        tree_cache: BasePrefixCache,
        port: SchedulerPort,
        stream_interval: int,
        handoff: PrefillHandoff,
    ) -> None:
        """stream_interval: emit a streaming request every this many tokens unless its own
        sampling params say otherwise; handoff: the prefill role's hand-over (disabled in
        other roles)."""
        self.tokenizer = tokenizer
        self.tree_cache = tree_cache
        self.port = port
        self.stream_interval = stream_interval
        self.handoff = handoff

    # ---- results --------------------------------------------------------------------------
    def process_batch_result_prefill(
        self, batch: ScheduleBatch, fb: ForwardBatch, result: GenerationBatchResult
    ) -> None:
        if fb.return_logprob:
            self._add_input_logprobs(batch, fb, result)
        decoding = {id(r) for r in batch.decoding_reqs} if batch.decoding_reqs else None
        j = 0
        for req in batch.reqs:
            if req.is_chunked:  # a non-final chunk: cache what was computed, sample nothing
                self.tree_cache.cache_unfinished_req(req, chunked=True)
                continue
            req.input_logprobs_done = True
            if req.finished():  # aborted while its prefill ran
                j += 1
                continue
            if req.sampling_params.max_new_tokens == 0:  # prefill only (e.g. n>1 cache warm-up)
                j += 1
                req.finished_reason = FinishReason.at_length(0)
                # KV covers the whole prompt (no output token is pending): cache all of it,
                # then drop the request's hold on it.
                self.tree_cache.cache_unfinished_req(req)
                self.tree_cache.release_req(req, len(req.fill_ids))
                continue
            self._append_token(req, result, j)
            j += 1
            self.check_finished(req)
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            elif decoding is not None and id(req) in decoding:
                continue  # a decode step riding in a mixed batch: its prompt is cached already
            elif self.handoff.should_transfer(req):
                self.handoff.transfer_prefilled(req)
            else:
                # Make the prompt's KV shareable with requests arriving meanwhile.
                self.tree_cache.cache_unfinished_req(req)
        self.stream_output([r for r in batch.reqs if not r.is_chunked])

    def process_batch_result_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        for j, req in enumerate(batch.reqs):
            if req.finished():
                continue
            self._append_token(req, result, j)
            self.check_finished(req)
            if req.finished():
                self.tree_cache.cache_finished_req(req)
        self.stream_output(batch.reqs)

    def process_batch_result_embedding(self, batch: ScheduleBatch, embeddings: torch.Tensor) -> None:
        out = BatchEmbeddingOut()
        rows = embeddings.float().cpu().tolist()
        for req, emb in zip(batch.reqs, rows):
            req.embedding = emb
            req.finished_reason = FinishReason.at_length(0)
            # Embedding KV is not reusable (encoders) and not worth caching: release it all.
            self.tree_cache.release_req(req, len(req.fill_ids))
            out.results.append(EmbeddingOut(req.rid, emb, len(req.origin_input_ids), req.finished_reason))
        self.port.send_output(out)

    def _append_token(self, req: Req, result: GenerationBatchResult, j: int) -> None:
        sample = result.sample
        assert sample is not None
        req.output_ids.append(int(sample.next_token_ids[j]))
        self._advance_grammar(req)
        if not req.return_logprob:
            return
        if sample.next_token_logprobs is not None:
            req.output_token_logprobs.append(float(sample.next_token_logprobs[j]))
        if req.top_logprobs_num > 0 and sample.top_logprobs is not None:
            req.output_top_logprobs.append(sample.top_logprobs[j])
        if req.token_ids_logprob is not None and sample.token_ids_logprobs is not None:
            req.output_token_ids_logprobs.append(sample.token_ids_logprobs[j] or [])

    def _add_input_logprobs(self, batch: ScheduleBatch, fb: ForwardBatch, result: GenerationBatchResult) -> None:
        """Input logprobs of this extend segment. Row j of segment i (absolute position
        pre+j) predicts fill token pre+j+1; rows [start, n-1) come from input_logits, and a
        non-final chunk's last row (next_token_logits[i]) predicts the next chunk's first token."""
        out = result.logits_output
        offset = 0
        for i, req in enumerate(batch.reqs):
            pre, n = fb.extend_prefix_lens_cpu[i], fb.extend_seq_lens_cpu[i]
            start = fb.extend_logprob_start_lens_cpu[i]
            if start >= n:
                continue
            k = n - 1 - start
            parts = []
            if k > 0:
                assert out.input_logits is not None
                parts.append(out.input_logits[offset : offset + k])
                offset += k
            targets = req.fill_ids[pre + start + 1 : pre + n]
            if req.is_chunked:
                parts.append(out.next_token_logits[i : i + 1])
                targets = targets + [req.origin_input_ids[pre + n]]
            if not parts:
                continue
            if not req.input_token_logprobs and req.logprob_start_len == 0:
                # The first prompt token has no prediction: None, and an empty row in the
                # top / token-id lists, so entry k of every list is about prompt token k.
                req.input_token_logprobs.append(None)
                if req.top_logprobs_num:
                    req.input_top_logprobs.append([])
                if req.token_ids_logprob is not None:
                    req.input_token_ids_logprobs.append([])
            lp = compute_logprobs(
                torch.cat(parts),
                torch.tensor(targets, dtype=torch.int64, device=parts[0].device),
                [req.top_logprobs_num] * len(targets) if req.top_logprobs_num else None,
                [req.token_ids_logprob] * len(targets) if req.token_ids_logprob is not None else None,
            )
            assert lp.token_logprobs is not None
            req.input_token_logprobs.extend(lp.token_logprobs.tolist())
            if lp.top_logprobs is not None:
                req.input_top_logprobs.extend(lp.top_logprobs)
            if lp.token_ids_logprobs is not None:
                req.input_token_ids_logprobs.extend(x or [] for x in lp.token_ids_logprobs)

    @staticmethod
    def _advance_grammar(req: Req) -> None:
        """Feed the newest output token to req's matcher; a token the grammar refuses (the
        mask allowed nothing else, e.g. min_new_tokens masked the only allowed stop token)
        ends the request with an error."""
        if req.grammar is None or req.finished():
            return
        token = req.output_ids[-1]
        if not req.grammar.accept_token(token):
            req.finished_reason = FinishReason.aborted(
                f"constrained decoding: sampled token {token} is not allowed by the grammar of "
                f"sampling_params (json_schema / regex / ebnf) after {len(req.output_ids) - 1} tokens; "
                "min_new_tokens, logit_bias or a stop token may leave no allowed token",
                AbortStatus.INTERNAL,
            )

    # ---- stop conditions ------------------------------------------------------------------
    def check_finished(self, req: Req) -> None:
        if req.finished():
            return
        sp = req.sampling_params
        last = req.output_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated():
            # The grammar ended (it accepted its stop token): finish as the stop token would.
            stop_ids = req.stop_token_ids | req.eos_token_ids
            req.finished_reason = FinishReason.stopped(last if last in stop_ids else None)
        elif len(req.output_ids) >= sp.min_new_tokens and last in req.stop_token_ids:
            req.finished_reason = FinishReason.stopped(last)
        elif sp.stop_strs and self.tokenizer is not None:
            tail = self.tokenizer.decode(req.output_ids[-(sp.stop_str_max_len + 1) :])
            for stop in sp.stop_strs:
                if stop in tail:
                    req.finished_reason = FinishReason.stopped(stop)
                    break
        if req.finished_reason is None and len(req.output_ids) >= (sp.max_new_tokens or 0):
            req.finished_reason = FinishReason.at_length(len(req.output_ids))

    # ---- outputs --------------------------------------------------------------------------
    def reject(self, req: Req, message: str, status_code: int = AbortStatus.BAD_REQUEST) -> None:
        """End a request that cannot run with an error naming why (it holds no KV)."""
        self.abort(req, FinishReason.aborted(message, status_code))

    def abort(self, req: Req, reason: FinishReason) -> None:
        """Finish a request that holds no KV with `reason` and emit it."""
        req.finished_reason = reason
        self.stream_output([req])

    def _should_emit(self, req: Req) -> bool:
        """Finished requests always emit; others at their stream cadence, except while the
        output ends with the start of a stop string (text that a later match would trim)."""
        if req.finished():
            return True
        n = len(req.output_ids)
        if req.stream:
            interval = req.sampling_params.stream_interval or self.stream_interval
            due = n == 1 or n - req.send_token_offset >= interval
        else:
            due = n % FORCE_STREAM_INTERVAL == 0
        return due and not self._tail_starts_stop_str(req)

    def _tail_starts_stop_str(self, req: Req) -> bool:
        """SGLang's check_match_stop_str_prefix: whether the decoded output tail ends with a
        non-empty prefix of one of the request's stop strings."""
        sp = req.sampling_params
        if not sp.stop_strs or self.tokenizer is None:
            return False
        tail = self.tokenizer.decode(req.output_ids[-(sp.stop_str_max_len + 1) :])
        return any(tail.endswith(stop[:k]) for stop in sp.stop_strs for k in range(1, min(len(tail), len(stop)) + 1))

    def stream_output(self, reqs: list[Req]) -> None:
        out = BatchTokenIDOut()
        now = time.time()
        for req in reqs:
            times = req.times
            if req.output_ids and not times.first_token:
                times.first_token = now
            if req.finished_reason is not None and not times.finished:
                times.finished = now
            if req.transferred or not self._should_emit(req):
                continue
            delta = TokenDelta(
                rid=req.rid,
                output_ids=req.output_ids[req.send_token_offset :],
                finish_reason=req.finished_reason,
                prompt_tokens=len(req.origin_input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                retraction_count=req.retraction_count,
                logprobs=self._logprob_delta(req) if req.return_logprob else None,
                prompt_tail_ids=req.origin_input_ids[-5:] if req.send_token_offset == 0 else [],
                times=times,
            )
            req.send_token_offset = len(req.output_ids)
            out.deltas.append(delta)
        if out.deltas:
            self.port.send_output(out)

    @staticmethod
    def _logprob_delta(req: Req) -> LogprobDelta:
        """The logprobs not sent yet: the prompt's once (when complete), then the new outputs'."""
        lp = LogprobDelta()
        if req.input_logprobs_done and not req.input_logprobs_sent:
            req.input_logprobs_sent = True
            lp.input_token_logprobs = list(req.input_token_logprobs)
            lp.input_token_ids = req.origin_input_ids[req.logprob_start_len :]
            lp.input_top_logprobs = list(req.input_top_logprobs)
            lp.input_token_ids_logprobs = list(req.input_token_ids_logprobs)
        k = req.send_logprob_offset
        lp.output_token_logprobs = req.output_token_logprobs[k:]
        lp.output_top_logprobs = req.output_top_logprobs[k:]
        lp.output_token_ids_logprobs = req.output_token_ids_logprobs[k:]
        req.send_logprob_offset = len(req.output_token_logprobs)
        return lp
