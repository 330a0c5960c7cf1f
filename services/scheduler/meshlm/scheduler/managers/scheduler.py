"""Scheduler: the event loop of one scheduler (one per TP rank), as in SGLang's event_loop_normal.

    loop:  recv_requests -> parts.inputs.process_input_requests
           -> parts.grammar.move_ready_grammar_requests -> get_next_batch_to_run
           -> run_batch -> parts.output.process_batch_result_{prefill,decode,embedding}
           -> (idle: on_idle)

get_next_batch_to_run: merge the last prefill batch into the running batch (minus the
chunked request and finished ones); admit requests handed over by a prefill scheduler; a new
prefill batch has priority; otherwise one decode step of the running batch, retracting
requests when the KV pool cannot hold the next tokens.

The Scheduler adds the model worker (TpModelWorker) and this loop to its parts
(SchedulerParts: memory, state, input handling, prefill batching, retraction, output
processing and the two disaggregation halves), each constructed with what it needs. All
state is owned by the loop thread; the outside talks to it only through the port.

Tensor parallelism: every rank runs this same Scheduler on its shard. Rank 0 owns the port;
each iteration it drains its inbox and broadcasts the messages (and whether to stop) to the
other ranks, whose ports stay empty and discard outputs; with them go rank 0's decisions of
which constrained requests leave the grammar queue (compiles finish at different times on
each rank; the others wait for those same compiles). Every scheduling decision depends
only on those messages and on state they produced (never on clocks, on the values of object
ids or on unseeded randomness), and sampling sees all-gathered logits and an identically
seeded RNG, so every rank schedules, samples and stops identically and their collectives match.
"""

from __future__ import annotations

import threading
import time
import uuid

import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.distributed.parallel_state import broadcast_pyobj
from meshlm.scheduler.managers.batch_log import BatchLog, PrefillCounts
from meshlm.scheduler.managers.grammar_manager import GrammarDecision
from meshlm.scheduler.managers.io_struct import InputMessage, OpenSessionReq
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_parts import SchedulerParts
from meshlm.scheduler.managers.tokenizer_protocol import Tokenizer
from meshlm.scheduler.managers.tp_worker import TpModelWorker
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        port: SchedulerPort,
        tp: TpGroup = SINGLE,
        tp_cpu_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        """tp: this rank of the TP group; tp_cpu_group: the group's gloo CPU group (required
        when tp.size > 1), over which rank 0 broadcasts each iteration's inputs."""
        if tp.size > 1 and tp_cpu_group is None:
            raise ValueError("a tensor-parallel Scheduler needs the group's CPU process group")
        self.config, self.model_config, self.port = config, model_config, port
        self.tp, self.tp_cpu_group = tp, tp_cpu_group
        self.tp_worker = TpModelWorker(model_config, config, tp)
        memory = SchedulerMemory.from_runner(self.tp_worker.model_runner, config, model_config.vocab_size)
        self.parts = SchedulerParts.build(config, model_config, tokenizer, port, memory, tp.rank)
        self.memory, self.state, self.stats = memory, self.parts.state, self.parts.stats
        self.max_req_len = self.parts.max_req_len
        self.max_total_num_tokens = memory.max_total_num_tokens
        # Rank 0 logs the batches (every rank runs the same ones).
        self.batch_log = BatchLog(memory, self.state, config.decode_log_interval) if tp.rank == 0 else None
        self._stop = threading.Event()

    # ---- the loop -------------------------------------------------------------------------
    def event_loop_normal(self) -> None:
        """Run until stop() on rank 0 (on every rank: the stop travels with the inputs). The
        loop runs in inference mode (SGLang's DynamicGradMode): the forward's logits are
        inference tensors that sampling and penalties modify in place."""
        try:
            with torch.inference_mode():
                while True:
                    idle = self.state.last_batch is None and self.state.nothing_queued()
                    msgs, stop, grammar_ready = self.recv_requests(block=idle)
                    if stop:
                        return
                    self.parts.inputs.process_input_requests(msgs)
                    self.parts.grammar.move_ready_grammar_requests(grammar_ready)
                    self.step()
        finally:
            self.parts.grammar.shutdown()

    def recv_requests(self, block: bool) -> tuple[list[InputMessage], bool, list[GrammarDecision] | None]:
        """This iteration's input messages, whether the loop stops, and (tp > 1) which parked
        constrained requests move on; equal on every rank.

        Rank 0 decides to stop once stop() was called, else drains its port (waiting up to
        50 ms for a first message when `block`; a finished compile wakes it) and names unnamed
        sessions; with tp > 1 it decides the grammar queue's moves and broadcasts all three to
        the other ranks, which take them from that broadcast. With tp == 1 the grammar
        decisions are None: the queue decides after this iteration's inputs (a cached
        grammar's request then moves at once).
        """
        msgs: list[InputMessage] = []
        stop = False
        ready: list[GrammarDecision] | None = None
        if self.tp.rank == 0:
            stop = self._stop.is_set()
            if not stop:
                msgs = self.port.recv_requests(block=block, timeout=0.05)
            for msg in msgs:
                if isinstance(msg, OpenSessionReq) and not msg.session_id:
                    msg.session_id = uuid.uuid4().hex  # drawn once, so every rank opens this id
        if self.tp.size > 1:
            assert self.tp_cpu_group is not None
            if self.tp.rank == 0:
                ready = self.parts.grammar.ready_decisions()
            msgs, stop, ready = broadcast_pyobj((msgs, stop, ready), self.tp.rank, self.tp_cpu_group)
        return msgs, stop, ready

    def step(self) -> ScheduleBatch | None:
        """One iteration after input processing: schedule, run, process. Returns the batch run."""
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            batch_log = self.batch_log
            counts = (
                PrefillCounts.of(batch, self.state)
                if batch_log is not None and batch.forward_mode.is_extend()
                else None
            )
            forward_s = self.run_batch(batch)
            if batch.forward_mode is ForwardMode.DECODE:
                self.stats.record_decode(len(batch.reqs), forward_s, time.perf_counter() - t0)
                if batch_log is not None:
                    batch_log.decode(batch, forward_s)
            elif batch.decoding_reqs:
                self.stats.record_mixed_decode(len(batch.decoding_reqs))
            if batch_log is not None and counts is not None:
                batch_log.prefill(counts, forward_s)
        else:
            self.on_idle()
        self.state.last_batch = batch
        return batch

    def stop(self) -> None:
        self._stop.set()

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        state = self.state
        last = state.last_batch
        if last is not None and last.forward_mode is ForwardMode.EXTEND and last.sampling_reqs:
            keep = [i for i, r in enumerate(last.sampling_reqs) if not r.finished()]
            if len(keep) != len(last.sampling_reqs):
                assert last.sampling_info is not None
                last.sampling_info.filter_batch(keep)
                last.sampling_reqs = [last.sampling_reqs[i] for i in keep]
            state.running_batch.merge_batch(last)
        if state.transfer_queue:
            self.parts.decode_side.admit_transferred()
        new_batch = self.parts.prefill.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not state.running_batch.is_empty():
            self.parts.retractor.update_running_batch(state.running_batch)
            if not state.running_batch.is_empty():
                return state.running_batch
        return None

    def run_batch(self, batch: ScheduleBatch) -> float:
        """Run the prepared forward and process its result; returns the forward's seconds."""
        fb = batch.pending_fb
        assert fb is not None
        batch.pending_fb = None
        if fb.forward_mode.is_extend():
            # A mixed batch's decoding requests add one decode token each, not prefill work.
            self.stats.extend_tokens += sum(fb.extend_seq_lens_cpu) - len(batch.decoding_reqs)
        if batch.forward_mode is ForwardMode.EMBED:
            t0 = time.perf_counter()
            embeddings = self.tp_worker.forward_batch_embedding(fb)
            self.parts.output.process_batch_result_embedding(batch, embeddings)
            return time.perf_counter() - t0
        result = self.tp_worker.forward_batch_generation(batch, fb)
        if batch.forward_mode is ForwardMode.DECODE:
            self.parts.output.process_batch_result_decode(batch, result)
        else:
            self.parts.output.process_batch_result_prefill(batch, fb, result)
        return result.forward_seconds

    def on_idle(self) -> None:
        """Nothing ran this iteration: reset the decode reserve; with nothing queued, check
        that every KV slot and row came back."""
        self.parts.retractor.reset_new_token_ratio()
        if self.state.nothing_queued():
            self.memory.check_idle()
