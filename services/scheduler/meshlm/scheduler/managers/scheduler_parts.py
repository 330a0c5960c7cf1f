"""SchedulerParts: the parts of one scheduler loop, each constructed with what it needs.

    memory       SchedulerMemory     request rows, KV pool, allocator, prefix cache
    state        SchedulerState      where each live request is
    stats        SchedulerStats      counters
    output       OutputProcessor     forward results -> request state, KV caching, deltas out
    handoff      PrefillHandoff      prefill role: hand prefilled requests to a decode scheduler
    decode_side  DecodeAdmission     check, queue and admit handed-over requests
    inputs       InputHandler        requests, aborts, sessions, flush, load reports
    prefill      PrefillBatcher      the next prefill batch
    retractor    Retractor           keep the running batch decodable

Built apart from the Scheduler (which adds the model worker and the loop), so the parts can
be put together over any pools, e.g. small CPU pools in unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.disaggregation.decode import DecodeAdmission
from meshlm.scheduler.disaggregation.prefill import PrefillHandoff
from meshlm.scheduler.managers.input_handler import InputHandler
from meshlm.scheduler.managers.output_processor import OutputProcessor
from meshlm.scheduler.managers.port import SchedulerPort
from meshlm.scheduler.managers.prefill_batcher import PrefillBatcher
from meshlm.scheduler.managers.request_checks import RequestValidator
from meshlm.scheduler.managers.retraction import Retractor, initial_new_token_ratio
from meshlm.scheduler.managers.scheduler_memory import SchedulerMemory
from meshlm.scheduler.managers.scheduler_state import SchedulerState
from meshlm.scheduler.managers.scheduler_stats import SchedulerStats
from meshlm.scheduler.managers.session_controller import SessionController
from meshlm.scheduler.managers.tokenizer_protocol import Tokenizer
from meshlm.scheduler.model_config import ModelConfig


@dataclass(frozen=True)
class SchedulerParts:
    max_req_len: int  # most tokens (prompt + outputs) one request may hold
    memory: SchedulerMemory
    state: SchedulerState
    stats: SchedulerStats
    output: OutputProcessor
    handoff: PrefillHandoff
    decode_side: DecodeAdmission
    inputs: InputHandler
    prefill: PrefillBatcher
    retractor: Retractor

    @classmethod
    def build(
        cls,
        config: SchedulerConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        port: SchedulerPort,
        memory: SchedulerMemory,
    ) -> SchedulerParts:
        # A request's prompt + outputs must fit both the context and the whole KV pool.
        max_req_len = min(model_config.context_len, memory.max_total_num_tokens) - 1
        state = SchedulerState(
            running_batch=memory.new_batch([]),
            new_token_ratio=initial_new_token_ratio(config.schedule_conservativeness),
        )
        stats = SchedulerStats()
        validator = RequestValidator(model_config, tokenizer, max_req_len)
        prefill_role = config.disaggregation_mode == "prefill"
        handoff = PrefillHandoff(prefill_role, memory, port)
        output = OutputProcessor(tokenizer, memory.tree_cache, port, config.stream_interval, handoff)
        decode_side = DecodeAdmission(prefill_role, config.page_size, validator, memory, state, output)
        inputs = InputHandler(
            port=port,
            is_embedding_model=model_config.is_embedding,
            max_queued_requests=config.max_queued_requests,
            validator=validator,
            sessions=SessionController(max_req_len, tokenizer),
            state=state,
            memory=memory,
            output=output,
            decode_side=decode_side,
            stats=stats,
        )
        return cls(
            max_req_len=max_req_len,
            memory=memory,
            state=state,
            stats=stats,
            output=output,
            handoff=handoff,
            decode_side=decode_side,
            inputs=inputs,
            prefill=PrefillBatcher(config, memory, state, stats),
            retractor=Retractor(config.schedule_conservativeness, memory, state, output, stats),
        )
