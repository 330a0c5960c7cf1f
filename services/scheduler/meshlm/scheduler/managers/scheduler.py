"""Scheduler: the event loop of one scheduler (one per TP rank), as in SGLang's event_loop_normal.

    loop:  recv_requests -> process_input_requests -> get_next_batch_to_run
           -> run_batch -> process_batch_result (extend | decode | embed) -> (idle: on_idle)

get_next_batch_to_run: merge the last prefill batch into the running batch (minus the
chunked request and finished ones); a new prefill batch has priority; otherwise one decode step
of the running batch, retracting requests when the KV pool cannot hold the next tokens.

All state is owned by the loop thread; the outside talks to it only through the port.

Tensor parallelism: every rank runs this same Scheduler on its shard. Rank 0 owns the port;
each iteration it drains its inbox and broadcasts the messages (and whether to stop) to the
other ranks, whose ports stay empty and discard outputs. Every scheduling decision depends
only on those messages and on state they produced (never on clocks, on the values of object
ids or on unseeded randomness), and sampling sees all-gathered logits and an identically
seeded RNG, so every rank schedules, samples and stops identically and their collectives match.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Optional

import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.distributed.parallel_state import broadcast_pyobj
from meshlm.scheduler.managers.io_struct import (
    AbortReq,
    CloseSessionReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetLoadReq,
    LoadReport,
    OpenSessionReq,
    PrefilledReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from meshlm.scheduler.managers.disaggregation import DisaggregationMixin
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.req import FinishAbort, Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.schedule_policy import (
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)
from meshlm.scheduler.managers.scheduler_output import SchedulerOutputMixin
from meshlm.scheduler.managers.session_controller import SessionController
from meshlm.scheduler.managers.tp_worker import TpModelWorker
from meshlm.scheduler.mem_cache.chunk_cache import ChunkCache
from meshlm.scheduler.mem_cache.radix_cache import RadixCache
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode
from meshlm.scheduler.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRACT_DECODE_STEPS = 20
IN_BATCH_PREFIX_TOKENS = 32  # SGLang's IN_BATCH_PREFIX_CACHING thresholds


class Scheduler(SchedulerOutputMixin, DisaggregationMixin):
    def __init__(
        self,
        config: SchedulerConfig,
        model_config: ModelConfig,
        tokenizer: Any,
        port: SchedulerPort,
        tp: TpGroup = SINGLE,
        tp_cpu_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        """tp: this rank of the TP group; tp_cpu_group: the group's gloo CPU group (required
        when tp.size > 1), over which rank 0 broadcasts each iteration's inputs."""
        if tp.size > 1 and tp_cpu_group is None:
            raise ValueError("a tensor-parallel Scheduler needs the group's CPU process group")
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.port = port
        self.tp = tp
        self.tp_cpu_group = tp_cpu_group
        self.tp_worker = TpModelWorker(model_config, config, tp)
        runner = self.tp_worker.model_runner
        self.device = runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = runner.max_running_requests
        # A request's prompt + outputs must fit both the context and the whole KV pool.
        self.max_req_len = min(model_config.context_len, self.max_total_num_tokens) - 1
        cache_cls = ChunkCache if config.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(self.req_to_token_pool, self.allocator, config.page_size)
        self.policy = SchedulePolicy(config.schedule_policy, self.tree_cache, not config.disable_radix_cache)
        self.waiting_queue: list[Req] = []
        # Decode role: requests prefilled elsewhere, waiting for a row and KV slots here.
        self.transfer_queue: deque[tuple[Req, torch.Tensor]] = deque()
        self.running_batch = self._new_batch([])
        self.last_batch: Optional[ScheduleBatch] = None
        self.chunked_req: Optional[Req] = None
        self.init_new_token_ratio = min(0.7 * config.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * 0.14
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / 600
        self.new_token_ratio = self.init_new_token_ratio
        self.stats = SchedulerStats()
        self.sessions = SessionController(self.max_req_len, tokenizer)
        self._stop = threading.Event()

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(
            reqs, self.req_to_token_pool, self.allocator, self.tree_cache,
            self.model_config.vocab_size, self.device,
        )

    # ---- the loop -------------------------------------------------------------------------
    def event_loop_normal(self) -> None:
        """Run until stop() on rank 0 (on every rank: the stop travels with the inputs). The
        loop runs in inference mode (SGLang's DynamicGradMode): the forward's logits are
        inference tensors that sampling and penalties modify in place."""
        with torch.inference_mode():
            while True:
                idle = (
                    self.last_batch is None and not self.waiting_queue and not self.transfer_queue
                    and self.running_batch.is_empty()
                )
                msgs, stop = self.recv_requests(block=idle)
                if stop:
                    return
                self.process_input_requests(msgs)
                self.step()

    def recv_requests(self, block: bool) -> tuple[list[Any], bool]:
        """This iteration's input messages and whether the loop stops, equal on every rank.

        Rank 0 decides to stop once stop() was called, else drains its port (waiting up to
        50 ms for a first message when `block`) and names unnamed sessions; with tp > 1 it
        broadcasts both to the other ranks, which take them from that broadcast.
        """
        msgs: list[Any] = []
        stop = False
        if self.tp.rank == 0:
            stop = self._stop.is_set()
            if not stop:
                msgs = self.port.recv_requests(block=block, timeout=0.05)
            for msg in msgs:
                if isinstance(msg, OpenSessionReq) and not msg.session_id:
                    msg.session_id = uuid.uuid4().hex  # drawn once, so every rank opens this id
        if self.tp.size > 1:
            assert self.tp_cpu_group is not None
            msgs, stop = broadcast_pyobj((msgs, stop), self.tp.rank, self.tp_cpu_group)
        return msgs, stop

    def step(self) -> Optional[ScheduleBatch]:
        """One iteration after input processing: schedule, run, process. Returns the batch run."""
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            forward_s = self.run_batch(batch)
            if batch.forward_mode is ForwardMode.DECODE:
                self.stats.record_decode(len(batch.reqs), forward_s, time.perf_counter() - t0)
        else:
            self.on_idle()
        self.last_batch = batch
        return batch

    def stop(self) -> None:
        self._stop.set()

    # ---- inputs ---------------------------------------------------------------------------
    def process_input_requests(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, PrefilledReq):
                self.handle_prefilled_request(msg)
            elif isinstance(msg, TokenizedEmbeddingReqInput):
                self.handle_embedding_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg)
            elif isinstance(msg, FlushCacheReq):
                out = self.flush_cache()
                out.call_id = msg.call_id
                self.port.send_control(out)
            elif isinstance(msg, GetLoadReq):
                load = self.get_load()
                load.call_id = msg.call_id
                self.port.send_control(load)
            elif isinstance(msg, OpenSessionReq):
                self.port.send_control(self.sessions.open(msg))
            elif isinstance(msg, CloseSessionReq):
                self.port.send_control(self.sessions.close(msg))
            else:
                logger.error("scheduler got an unknown message %r", type(msg).__name__)

    def _reject(self, req: Req, message: str, status_code: int = 400) -> None:
        err = {400: "BadRequestError", 404: "NotFoundError"}.get(status_code, "ServiceUnavailableError")
        req.finished_reason = FinishAbort(message, status_code, err)
        self.stream_output([req])

    def _queue_full(self) -> bool:
        cap = self.config.max_queued_requests
        return cap is not None and len(self.waiting_queue) >= cap

    def new_req(self, recv: TokenizedGenerateReqInput, input_ids: list[int]) -> Req:
        return Req(
            recv.rid, input_ids, recv.sampling_params,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob,
            stream=recv.stream,
            origin_input_text=recv.input_text,
            session_id=recv.session_id,
        )

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        input_ids, session_error = recv.input_ids, None
        if recv.session_id is not None:
            input_ids, session_error = self.sessions.resolve_input(recv)
        req = self.new_req(recv, input_ids)
        if session_error is not None:
            return self._reject(req, *session_error)
        error = self._validate(req)
        if error is None and recv.session_id is not None:
            error = self.sessions.check_capacity(req)
        if error is not None:
            return self._reject(req, error)
        if self.model_config.is_embedding:
            return self._reject(req, "this model is an embedding model; it cannot generate")
        if self._queue_full():
            return self._reject(req, "The request queue is full.", 503)
        if recv.session_id is not None:
            self.sessions.add_req(recv, req)
        self.waiting_queue.append(req)

    def _too_long(self, n: int) -> str:
        """The error for an input of n > max_req_len tokens; names the input length, the
        model's context length and the most input tokens a request may hold."""
        return (
            f"The input ({n} tokens) is longer than the model's context length "
            f"({self.model_config.context_len} tokens; a request may hold at most {self.max_req_len} input tokens)."
        )

    def _validate(self, req: Req) -> Optional[str]:
        """SGLang's handle_generate_request checks; returns an error naming field and limit."""
        n = len(req.origin_input_ids)
        sp = req.sampling_params
        if n == 0:
            return "input_ids must not be empty"
        if n > self.max_req_len:
            return self._too_long(n)
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.origin_input_ids):
            return f"input_ids must be token ids in [0, {self.model_config.vocab_size})"
        try:
            sp.verify(self.model_config.vocab_size)
            sp.normalize(self.tokenizer)
        except ValueError as e:
            return str(e)
        if req.top_logprobs_num < 0:
            return f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
        for t in req.token_ids_logprob or ():
            if not 0 <= t < self.model_config.vocab_size:
                return f"token_ids_logprob must be in [0, {self.model_config.vocab_size}), got {t}"
        if req.return_logprob:
            if req.logprob_start_len == -1:
                req.logprob_start_len = n - 1
            if not 0 <= req.logprob_start_len < n:
                return f"logprob_start_len must be in [0, {n}) (the input length) or -1, got {req.logprob_start_len}"
        # Clamp max_new_tokens to what the context and the KV pool can hold.
        room = self.max_req_len - n
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        if sp.min_new_tokens > sp.max_new_tokens:
            sp.min_new_tokens = sp.max_new_tokens
        return None

    def handle_embedding_request(self, recv: TokenizedEmbeddingReqInput) -> None:
        sp = SamplingParams(max_new_tokens=0)
        req = Req(recv.rid, recv.input_ids, sp, is_embedding=True, origin_input_text=recv.input_text)
        n = len(req.origin_input_ids)
        if n == 0:
            return self._reject(req, "input must not be empty")
        if n > self.max_req_len:
            return self._reject(req, self._too_long(n))
        if self._queue_full():
            return self._reject(req, "The request queue is full.", 503)
        self.waiting_queue.append(req)

    def abort_request(self, abort: AbortReq) -> None:
        """Abort matching requests wherever they are; their KV is released at once."""

        def hit(rid: str) -> bool:
            return abort.abort_all or rid == abort.rid or rid.startswith(abort.rid + "_")

        reason = FinishAbort(abort.message, 499, "Aborted")
        self.abort_transferred(hit, reason)
        for req in [r for r in self.waiting_queue if hit(r.rid)]:
            self.waiting_queue.remove(req)  # waiting requests hold no KV and no locks
            req.finished_reason = reason
            self.stream_output([req])
        if self.chunked_req is not None and hit(self.chunked_req.rid):
            req, self.chunked_req = self.chunked_req, None
            self.tree_cache.release_req(req, len(req.fill_ids))
            req.finished_reason = reason
            self.stream_output([req])
        running = list(self.running_batch.reqs)
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            running += self.last_batch.sampling_reqs  # prefilled, not merged yet
        for req in running:
            if hit(req.rid) and not req.finished():
                req.finished_reason = reason
                self.tree_cache.cache_finished_req(req)
                self.stream_output([req])

    def has_live_requests(self) -> bool:
        """Whether any unfinished request is waiting, chunked, decoding or just prefilled (an
        EXTEND batch's requests join the running batch only at the next get_next_batch_to_run,
        and finished ones leave it only then)."""
        return bool(
            self.waiting_queue or self.transfer_queue or self.chunked_req is not None or self._running_reqs()
        )

    def _running_reqs(self) -> list[Req]:
        """Unfinished requests holding KV: decoding, or prefilled and not merged yet."""
        live = list(self.running_batch.reqs)
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            live += [r for r in self.last_batch.sampling_reqs if r not in self.running_batch.reqs]
        return [r for r in live if not r.finished()]

    def flush_cache(self) -> FlushCacheOutput:
        """Drop every cached prefix; refused while a live request holds KV slots or a row."""
        if self.has_live_requests():
            return FlushCacheOutput(False, "Cache not flushed: requests are running or waiting.")
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return FlushCacheOutput(True, "Cache flushed.")

    def get_load(self) -> LoadReport:
        used = self.num_used_tokens()
        return LoadReport(
            num_running_reqs=len(self._running_reqs()),
            num_queue_reqs=len(self.waiting_queue) + len(self.transfer_queue),
            num_used_tokens=used,
            max_total_num_tokens=self.max_total_num_tokens,
            cache_hit_rate=self.stats.cache_hit_rate(),
            token_usage=used / self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            num_retracted_reqs=sum(r.retraction_count > 0 for r in self.waiting_queue),
        )

    def num_used_tokens(self) -> int:
        """KV slots held by requests (not free and not merely cached for reuse)."""
        return self.max_total_num_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()

    # ---- scheduling -----------------------------------------------------------------------
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        last = self.last_batch
        if last is not None and last.forward_mode is ForwardMode.EXTEND and last.sampling_reqs:
            keep = [i for i, r in enumerate(last.sampling_reqs) if not r.finished()]
            if len(keep) != len(last.sampling_reqs):
                assert last.sampling_info is not None
                last.sampling_info.filter_batch(keep)
                last.sampling_reqs = [last.sampling_reqs[i] for i in keep]
            self.running_batch.merge_batch(last)
        if self.transfer_queue:
            self.admit_transferred()
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            self.update_running_batch(self.running_batch)
            if not self.running_batch.is_empty():
                return self.running_batch
        return None

    def _match_prefix(self, req: Req) -> None:
        """Find the cached prefix of req's fill_ids (at least one token is always computed;
        with input logprobs wanted, no further than logprob_start_len)."""
        req.fill_ids = req.origin_input_ids + req.output_ids
        limit = len(req.fill_ids) - 1
        if req.return_logprob and not req.input_logprobs_done:
            # Row logprob_start_len-1 predicts the first wanted token: it must be computed.
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        if req.is_embedding:
            limit = 0
        match = self.tree_cache.match_prefix(req.fill_ids[:limit])
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        req.cache_protected_len = len(req.prefix_indices)
        req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running_bs = len(self.running_batch.reqs)
        if running_bs >= self.max_running_requests and self.chunked_req is None:
            return None
        for req in self.waiting_queue:
            self._match_prefix(req)
        self.policy.calc_priority(self.waiting_queue)
        chunk = None if self.config.chunked_prefill_size == -1 else self.config.chunked_prefill_size
        adder = PrefillAdder(
            self.tree_cache, self.allocator, self.running_batch.reqs, self.new_token_ratio,
            self.config.max_prefill_tokens, chunk, self.config.page_size,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.add_chunked_req(self.chunked_req)
        embed = self.chunked_req.is_embedding if self.chunked_req else None
        # In-batch prefix sharing: a request whose first tokens equal those of a request
        # picked this round waits one round, then finds that prefix in the radix cache
        # instead of computing it again.
        share = not self.config.disable_radix_cache
        picked_heads = {self._head(self.chunked_req)} if self.chunked_req is not None else set()
        for req in self.waiting_queue:
            if running_bs + len(adder.can_run_list) >= self.max_running_requests:
                break
            if embed is not None and req.is_embedding != embed:
                break  # one kind of forward per batch
            head = self._head(req)
            if share and adder.can_run_list and req.cache_protected_len < IN_BATCH_PREFIX_TOKENS and head in picked_heads:
                continue
            res = adder.add_one_req(req)
            added = bool(adder.can_run_list) and adder.can_run_list[-1] is req
            if added:
                embed = req.is_embedding
                picked_heads.add(head)
            if res is not AddReqResult.CONTINUE or adder.new_chunked_req is not None:
                break
        if not adder.can_run_list:
            return None
        picked = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in picked]
        self.chunked_req = adder.new_chunked_req
        for req in adder.can_run_list:
            if not req.times.scheduled:
                req.times.scheduled = time.time()
            if req.is_chunked <= 1 and not req.output_ids:  # first time this prompt runs
                req.cached_tokens = req.cache_protected_len
                self.stats.record_prefill(len(req.origin_input_ids), req.cache_protected_len)
        batch = self._new_batch(adder.can_run_list)
        batch.pending_fb = batch.prepare_for_extend(embed=bool(embed))
        return batch

    @staticmethod
    def _head(req: Req) -> tuple[int, ...]:
        """The first tokens of a request: equal heads mean a shared prefix worth reusing.

        A short request's head holds id(req) only to be unique among live requests: it equals
        no other head, so decisions never depend on the id's value (same on every TP rank)."""
        if len(req.fill_ids) <= IN_BATCH_PREFIX_TOKENS:
            return (-1, id(req))  # too short to share: unique
        return tuple(req.fill_ids[:IN_BATCH_PREFIX_TOKENS])

    def update_running_batch(self, batch: ScheduleBatch) -> None:
        batch.filter_batch([i for i, r in enumerate(batch.reqs) if not r.finished()])
        if batch.is_empty():
            return
        if not batch.check_decode_mem():
            retracted = self.retract_decode(batch)
            self.waiting_queue = retracted + self.waiting_queue
            total_out = sum(len(r.output_ids) for r in batch.reqs)
            total_max = sum(r.sampling_params.max_new_tokens or 0 for r in batch.reqs)
            self.new_token_ratio = min(
                1.0, (total_out + RETRACT_DECODE_STEPS * len(batch.reqs)) / (total_max + 1)
            )
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if not batch.is_empty():
            batch.pending_fb = batch.prepare_for_decode()

    def retract_decode(self, batch: ScheduleBatch) -> list[Req]:
        """Release requests (fewest outputs first, then longest input) until the next decode
        step fits; they re-enter the waiting queue and are prefilled again later."""
        order = sorted(
            range(len(batch.reqs)),
            key=lambda i: (len(batch.reqs[i].output_ids), -len(batch.reqs[i].origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []
        while True:
            kept = sorted(order)
            view = self._new_batch([batch.reqs[i] for i in kept])
            if view.check_decode_mem() or not order:
                break
            victim = batch.reqs[order.pop()]
            if not order:  # even a lone request cannot grow: fail it rather than spin
                victim.finished_reason = FinishAbort("KV cache is too small for this request", 500, "InternalServerError")
                self.tree_cache.cache_finished_req(victim)
                self.stream_output([victim])
                break
            self.tree_cache.release_req(victim, victim.seqlen - 1)
            victim.reset_for_retract()
            retracted.append(victim)
            self.stats.num_retracted += 1
        batch.filter_batch(sorted(order))
        logger.info("retracted %d requests; %d keep decoding", len(retracted), len(batch.reqs))
        return retracted

    # ---- running --------------------------------------------------------------------------
    def run_batch(self, batch: ScheduleBatch) -> float:
        """Run the prepared forward and process its result; returns the forward's seconds."""
        fb = batch.pending_fb
        assert fb is not None
        batch.pending_fb = None
        if fb.forward_mode.is_extend():
            self.stats.extend_tokens += sum(fb.extend_seq_lens_cpu)
        if batch.forward_mode is ForwardMode.EMBED:
            t0 = time.perf_counter()
            embeddings = self.tp_worker.forward_batch_embedding(fb)
            self.process_batch_result_embedding(batch, embeddings)
            return time.perf_counter() - t0
        result = self.tp_worker.forward_batch_generation(batch, fb)
        if batch.forward_mode is ForwardMode.DECODE:
            self.process_batch_result_decode(batch, result)
        else:
            self.process_batch_result_prefill(batch, fb, result)
        return result.forward_seconds

    def on_idle(self) -> None:
        self.new_token_ratio = self.init_new_token_ratio
        if (
            self.chunked_req is None and not self.waiting_queue and not self.transfer_queue
            and self.running_batch.is_empty()
        ):
            self.check_memory()

    def check_memory(self) -> None:
        """When nothing runs, every KV slot is free or cached and no request row is held."""
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        if free != self.max_total_num_tokens or self.tree_cache.protected_size() != 0:
            raise RuntimeError(
                f"KV leak: free {self.allocator.available_size()} + evictable "
                f"{self.tree_cache.evictable_size()} != {self.max_total_num_tokens}, "
                f"protected {self.tree_cache.protected_size()}"
            )
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            raise RuntimeError("request slot leak: rows still held while idle")


class SchedulerStats:
    """Counters for metrics and the benchmark's overhead figure."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # Tokens computed by EXTEND / EMBED forwards (prompt tokens not served from the cache,
        # plus prompt and outputs of retracted requests prefilled again).
        self.extend_tokens = 0
        self.num_retracted = 0
        self.decode_steps = 0
        self.decode_forward_s = 0.0
        self.decode_step_s = 0.0
        self.generation_tokens = 0

    def record_prefill(self, prompt: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached

    def record_decode(self, bs: int, forward_s: float, step_s: float) -> None:
        self.decode_steps += 1
        self.generation_tokens += bs
        self.decode_forward_s += forward_s
        self.decode_step_s += step_s

    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
