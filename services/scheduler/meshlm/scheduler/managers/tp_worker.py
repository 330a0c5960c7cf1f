"""TpModelWorker: one forward + sampling step for a ScheduleBatch (SGLang's tp_worker)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.layers.logits_processor import LogitsProcessorOutput
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch
from meshlm.scheduler.model_executor.model_runner import ModelRunner
from meshlm.scheduler.sampling.sampler import SampleOutput, Sampler


@dataclass
class GenerationBatchResult:
    logits_output: LogitsProcessorOutput
    # Rows follow batch.sampling_reqs (EXTEND) or batch.reqs (DECODE).
    sample: SampleOutput | None
    forward_seconds: float


class TpModelWorker:
    def __init__(self, model_config: ModelConfig, config: SchedulerConfig, tp: TpGroup = SINGLE) -> None:
        self.model_runner = ModelRunner(model_config, config, tp)
        ops = self.model_runner.cpu_ops
        self.sampler = Sampler(ops.argmax, ops.supports_argmax) if ops is not None else Sampler()

    def forward_batch_generation(self, batch: ScheduleBatch, fb: ForwardBatch) -> GenerationBatchResult:
        t0 = time.perf_counter()
        out = self.model_runner.forward(fb)
        assert isinstance(out, LogitsProcessorOutput)
        forward_s = time.perf_counter() - t0
        reqs = batch.sampling_reqs if fb.forward_mode.is_extend() else batch.reqs
        if not reqs:
            return GenerationBatchResult(out, None, forward_s)
        logits = out.next_token_logits
        if len(reqs) != len(batch.reqs):  # drop rows of non-final chunks
            keep = [i for i, r in enumerate(batch.reqs) if not r.is_chunked]
            logits = logits[torch.tensor(keep, device=logits.device)]
        assert batch.sampling_info is not None
        want_lp = any(r.return_logprob for r in reqs)
        batch.sampling_info.update_regex_vocab_mask()  # constrained rows: applied in the sampler
        sample = self.sampler.forward(
            logits,
            batch.sampling_info,
            positions=[len(r.output_ids) for r in reqs],
            return_logprob=want_lp,
            top_logprobs_nums=[r.top_logprobs_num for r in reqs] if want_lp else None,
            token_ids_logprobs=[r.token_ids_logprob for r in reqs] if want_lp else None,
        )
        batch.sampling_info.cumulate_output_tokens(sample.next_token_ids)
        return GenerationBatchResult(out, sample, forward_s)

    def forward_batch_embedding(self, fb: ForwardBatch) -> torch.Tensor:
        out = self.model_runner.forward(fb)
        assert isinstance(out, torch.Tensor)
        return out
