"""BatchLog: SGLang's per-batch log lines (log_prefill_stats / log_decode_stats), with each
forward's milliseconds added.

    Prefill batch. #new-seq: 8, #new-token: 2048, #cached-token: 0, #mixed-decode: 0,
        token usage: 0.05, #running-req: 0, #queue-req: 56, forward: 2114 ms
    Decode batch. #running-req: 64, #token: 22528, token usage: 0.26, gen throughput
        (token/s): 498.1, #queue-req: 0, forward: 121 ms

Every prefill (EXTEND) batch gets a line; decode batches one every `decode_log_interval` steps
(SGLang's --decode-log-interval), whose throughput counts the generated tokens since the last
decode line (decode steps and mixed decode tokens) over the wall time since it, and whose
forward is the mean of the steps since it. Token usage is the share of KV slots that requests
hold (cached-only slots count as free). Logged at INFO on the scheduler's logger; interval 0
turns the decode lines off (prefill lines stay).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_state import SchedulerState
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode

log = logging.getLogger("meshlm.scheduler")


@dataclass(frozen=True)
class PrefillCounts:
    """What a prefill batch computes and who runs beside it, read before its forward (a
    chunked request's prefix grows during it, and the running requests merge after it)."""

    new_seqs: int  # requests prefilled here (a chunked request in every round it runs)
    new_tokens: int  # prompt tokens computed
    cached_tokens: int  # prompt tokens found in the prefix cache (a request's first round only)
    mixed_decode: int  # running requests whose decode step rides in the batch
    running: int  # requests decoding, in the batch or beside it

    @staticmethod
    def of(batch: ScheduleBatch, state: SchedulerState) -> PrefillCounts:
        decoding = {id(r) for r in batch.decoding_reqs}
        new = [r for r in batch.reqs if id(r) not in decoding]
        return PrefillCounts(
            new_seqs=len(new),
            new_tokens=sum(r.extend_input_len for r in new),
            cached_tokens=batch.cached_tokens,
            mixed_decode=len(batch.decoding_reqs),
            running=len(state.running_batch.reqs) + len(batch.decoding_reqs),
        )


class BatchLog:
    def __init__(self, memory: SchedulerMemory, state: SchedulerState, decode_log_interval: int) -> None:
        if decode_log_interval < 0:
            raise ValueError(f"decode_log_interval must be >= 0, got {decode_log_interval}")
        self.memory, self.state = memory, state
        self.interval = decode_log_interval
        self._decode_steps = 0
        self._decode_forward_s = 0.0
        self._generated = 0
        self._since = time.perf_counter()

    def token_usage(self) -> float:
        return self.memory.num_used_tokens() / self.memory.max_total_num_tokens

    def prefill(self, counts: PrefillCounts, forward_s: float) -> None:
        """After a prefill batch's forward (its requests already out of the waiting queue)."""
        self._generated += counts.mixed_decode
        if not log.isEnabledFor(logging.INFO):
            return
        log.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, #mixed-decode: %d, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d, forward: %.0f ms",
            counts.new_seqs,
            counts.new_tokens,
            counts.cached_tokens,
            counts.mixed_decode,
            self.token_usage(),
            counts.running,
            len(self.state.waiting_queue),
            1e3 * forward_s,
        )

    def decode(self, batch: ScheduleBatch, forward_s: float) -> None:
        """After a decode step of `batch`; every `interval` steps, a line."""
        assert batch.forward_mode is ForwardMode.DECODE
        self._decode_steps += 1
        self._decode_forward_s += forward_s
        self._generated += len(batch.reqs)
        if self.interval == 0 or self._decode_steps % self.interval:
            return
        now = time.perf_counter()
        throughput = self._generated / max(now - self._since, 1e-9)
        mean_forward = self._decode_forward_s / self.interval
        self._since, self._generated, self._decode_forward_s = now, 0, 0.0
        if not log.isEnabledFor(logging.INFO):
            return
        log.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.1f, "
            "#queue-req: %d, forward: %.0f ms",
            len(batch.reqs),
            self.memory.num_used_tokens(),
            self.token_usage(),
            throughput,
            len(self.state.waiting_queue),
            1e3 * mean_forward,
        )
