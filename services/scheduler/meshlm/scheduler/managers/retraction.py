"""Retractor: keep the running batch decodable (SGLang's update_running_batch and
retract_decode), and the new-token ratio that sizes the decode reserve of each prefill.

Before each decode step, finished requests leave the running batch. When the KV pool cannot
hold the step's new tokens (after evicting the cache), requests are retracted — fewest
outputs first, then longest input — until it can: their KV is released, and they go to the
front of the waiting queue to be prefilled again from prompt + outputs. A request that cannot
grow even alone is ended with an error instead of spinning.

new_token_ratio: the share of each running request's remaining tokens that a prefill reserves
(PrefillAdder). It decays by a fixed step per decode step to its minimum, jumps up after a
retraction (to what the batch really needed), and resets when the loop idles.
"""

from __future__ import annotations

import logging

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.scheduler.managers.output_processor import OutputProcessor
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_state import SchedulerState
from meshlm.scheduler.managers.scheduler_stats import SchedulerStats

logger = logging.getLogger(__name__)

RETRACT_DECODE_STEPS = 20  # decode steps a retraction's new ratio reserves for the survivors


def initial_new_token_ratio(schedule_conservativeness: float) -> float:
    return min(0.7 * schedule_conservativeness, 1.0)


class Retractor:
    def __init__(
        self,
        schedule_conservativeness: float,
        memory: SchedulerMemory,
        state: SchedulerState,
        output: OutputProcessor,
        stats: SchedulerStats,
    ) -> None:
        self.memory = memory
        self.state = state
        self.output = output
        self.stats = stats
        self.init_new_token_ratio = initial_new_token_ratio(schedule_conservativeness)
        self.min_new_token_ratio = self.init_new_token_ratio * 0.14
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / 600

    def reset_new_token_ratio(self) -> None:
        self.state.new_token_ratio = self.init_new_token_ratio

    def update_running_batch(self, batch: ScheduleBatch) -> None:
        """Drop finished requests, retract until the next decode step fits, prepare it."""
        state = self.state
        batch.filter_batch([i for i, r in enumerate(batch.reqs) if not r.finished()])
        if batch.is_empty():
            return
        if not batch.check_decode_mem():
            retracted = self.retract_decode(batch)
            state.waiting_queue = retracted + state.waiting_queue
            total_out = sum(len(r.output_ids) for r in batch.reqs)
            total_max = sum(r.sampling_params.max_new_tokens or 0 for r in batch.reqs)
            needed = total_out + RETRACT_DECODE_STEPS * len(batch.reqs)
            state.new_token_ratio = min(1.0, needed / (total_max + 1))
        else:
            decayed = state.new_token_ratio - self.new_token_ratio_decay
            state.new_token_ratio = max(decayed, self.min_new_token_ratio)
        if not batch.is_empty():
            batch.pending_fb = batch.prepare_for_decode()

    def retract_decode(self, batch: ScheduleBatch) -> list[Req]:
        """Release requests (fewest outputs first, then longest input) until the next decode
        step fits; returns them, in retraction order, ready to be prefilled again."""
        tree_cache = self.memory.tree_cache
        # Indices into batch.reqs, the next victim last.
        order = sorted(
            range(len(batch.reqs)),
            key=lambda i: (len(batch.reqs[i].output_ids), -len(batch.reqs[i].origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []
        while True:
            view = self.memory.new_batch([batch.reqs[i] for i in sorted(order)])
            if view.check_decode_mem() or not order:
                break
            victim = batch.reqs[order.pop()]
            if not order:  # even a lone request cannot grow: fail it rather than spin
                victim.finished_reason = FinishReason.aborted(
                    "KV cache is too small for this request", AbortStatus.INTERNAL
                )
                tree_cache.cache_finished_req(victim)
                self.output.stream_output([victim])
                break
            tree_cache.release_req(victim, victim.seqlen - 1)
            victim.reset_for_retract()
            retracted.append(victim)
            self.stats.num_retracted += 1
        batch.filter_batch(sorted(order))
        logger.info("retracted %d requests; %d keep decoding", len(retracted), len(batch.reqs))
        return retracted
