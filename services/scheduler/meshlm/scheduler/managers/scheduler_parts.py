"""SchedulerParts: the parts of one scheduler loop, each constructed with what it needs.

    memory       SchedulerMemory     request rows, KV pool, allocator, prefix cache
    state        SchedulerState      where each live request is
    stats        SchedulerStats      counters
    output       OutputProcessor     forward results -> request state, KV caching, deltas out
    grammar      GrammarManager      the grammar queue: constrained requests wait for their grammar
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
from meshlm.scheduler.constrained.backends import create_grammar_backend
from meshlm.scheduler.constrained.base_grammar_backend import BaseGrammarBackend
from meshlm.scheduler.constrained.compile_pool import GrammarCompilePool
from meshlm.scheduler.constrained.json_whitespace import JsonWhitespace
from meshlm.scheduler.disaggregation.decode import DecodeAdmission
from meshlm.scheduler.disaggregation.prefill import PrefillHandoff
from meshlm.scheduler.managers.grammar_manager import GRAMMAR_TIMEOUT_S, GrammarManager
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
from meshlm.scheduler.model_loader.tokenizer import hf_tokenizer


@dataclass(frozen=True)
class SchedulerParts:
    max_req_len: int  # most tokens (prompt + outputs) one request may hold
    memory: SchedulerMemory
    state: SchedulerState
    stats: SchedulerStats
    output: OutputProcessor
    grammar: GrammarManager
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
        tp_rank: int = 0,
    ) -> SchedulerParts:
        """tp_rank: this scheduler's TP rank (only rank 0's port is woken by compiles)."""
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
        grammar = GrammarManager(
            config.grammar_backend,
            grammar_pool(config, model_config, tokenizer, port if tp_rank == 0 else None),
            output,
            GRAMMAR_TIMEOUT_S,
        )
        decode_side = DecodeAdmission(prefill_role, config.page_size, validator, memory, state, output, grammar)
        inputs = InputHandler(
            port=port,
            is_embedding_model=model_config.is_embedding,
            max_queued_requests=config.max_queued_requests,
            validator=validator,
            sessions=SessionController(max_req_len, tokenizer),
            state=state,
            memory=memory,
            output=output,
            grammar=grammar,
            decode_side=decode_side,
            stats=stats,
        )
        return cls(
            max_req_len=max_req_len,
            memory=memory,
            state=state,
            stats=stats,
            output=output,
            grammar=grammar,
            handoff=handoff,
            decode_side=decode_side,
            inputs=inputs,
            prefill=PrefillBatcher(config, memory, state, stats),
            retractor=Retractor(config.schedule_conservativeness, memory, state, output, stats),
        )


def grammar_pool(
    config: SchedulerConfig, model_config: ModelConfig, tokenizer: Tokenizer | None, port: SchedulerPort | None
) -> GrammarCompilePool | None:
    """The compile pool of --grammar-backend over the model's tokenizer (None for "none");
    `port` is woken whenever a compile finishes."""
    if config.grammar_backend == "none":
        return None
    name = config.grammar_backend
    whitespace = JsonWhitespace(
        any_whitespace=not config.constrained_json_disable_any_whitespace,
        max_whitespace=config.constrained_json_max_whitespace,
    )
    vocab, eos = model_config.vocab_size, list(model_config.eos_token_ids)

    def make_backend() -> BaseGrammarBackend:
        if tokenizer is None:
            raise RuntimeError("structured output needs the model's tokenizer")
        return create_grammar_backend(name, hf_tokenizer(tokenizer), vocab, eos, whitespace)

    return GrammarCompilePool(make_backend, threads=2, cache_size=1024, on_done=port.wake if port else None)
