"""Sampling layer: request parameters, batched penalties and the token sampler."""

from __future__ import annotations

from meshlm.scheduler.sampling.penalties import BatchedPenalizer
from meshlm.scheduler.sampling.sampler import SampleOutput, Sampler, compute_logprobs
from meshlm.scheduler.sampling.sampling_batch_info import SamplingBatchInfo
from meshlm.scheduler.sampling.sampling_params import TOP_K_ALL, SamplingParams

__all__ = [
    "BatchedPenalizer",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "TOP_K_ALL",
    "compute_logprobs",
]
