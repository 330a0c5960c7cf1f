"""SchedulerStats: counters of one scheduler, for metrics and the benchmarks' overhead figure.

Updated on the loop thread only; readers on other threads see plain ints and floats (each
read is atomic, a set of reads is not a snapshot)."""

from __future__ import annotations


class SchedulerStats:
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

    def record_mixed_decode(self, bs: int) -> None:
        """bs running requests took their decode step inside a prefill batch."""
        self.mixed_decode_tokens += bs
        self.generation_tokens += bs

    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
