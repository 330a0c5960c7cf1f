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

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.distributed.parallel_state import broadcast_pyobj
from meshlm.scheduler.managers.disaggregation import DisaggregationMixin
from meshlm.scheduler.managers.io_struct import OpenSessionReq
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.schedule_policy import (
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)
from meshlm.scheduler.managers.scheduler_input import SchedulerInputMixin
from meshlm.scheduler.managers.scheduler_output import SchedulerOutputMixin
from meshlm.scheduler.managers.session_controller import SessionController
from meshlm.scheduler.managers.tp_worker import TpModelWorker
from meshlm.scheduler.mem_cache.chunk_cache import ChunkCache
from meshlm.scheduler.mem_cache.radix_cache import RadixCache
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode

logger = logging.getLogger(__name__)

RETRACT_DECODE_STEPS = 20
IN_BATCH_PREFIX_TOKENS = 32  # SGLang's IN_BATCH_PREFIX_CACHING thresholds


class Scheduler(SchedulerInputMixin, SchedulerOutputMixin, DisaggregationMixin):
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
            elif batch.decoding_reqs:
                self.stats.mixed_decode_tokens += len(batch.decoding_reqs)
                self.stats.generation_tokens += len(batch.decoding_reqs)
        else:
            self.on_idle()
        self.last_batch = batch
        return batch

    def stop(self) -> None:
        self._stop.set()

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
        # Mixed chunk: the running requests' decode tokens share this batch's token budgets.
        mixing = self.config.enable_mixed_chunk and not self.running_batch.is_empty()
        adder = PrefillAdder(
            self.tree_cache, self.allocator, self.running_batch.reqs, self.new_token_ratio,
            self.config.max_prefill_tokens, chunk, self.config.page_size,
            mixed_with_decode_tokens=running_bs if mixing else 0,
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
        if mixing and not embed:
            self.running_batch.filter_batch([i for i, r in enumerate(self.running_batch.reqs) if not r.finished()])
            if not self.running_batch.is_empty() and self.running_batch.check_decode_mem():
                batch.pending_fb = batch.mix_with_running(batch.pending_fb, self.running_batch)
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
                victim.finished_reason = FinishReason.aborted("KV cache is too small for this request", AbortStatus.INTERNAL)
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
        # Decode tokens computed inside prefill batches (--enable-mixed-chunk).
        self.mixed_decode_tokens = 0
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
