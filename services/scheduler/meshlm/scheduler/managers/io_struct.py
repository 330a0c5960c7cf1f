"""Messages into and out of the scheduler, as plain dataclasses (SGLang's io_struct).

They carry no protobuf: the gRPC servicer converts at the edge. Output messages are batched:
one BatchTokenIDOut per engine step, holding one TokenDelta per request that emits in it (and one
BatchEmbeddingOut per embedding batch, one EmbeddingOut per request). Finish reasons are
meshlm.common.finish.FinishReason, the type every service shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshlm.common.finish import FinishReason
from meshlm.scheduler.sampling.sampling_params import SamplingParams

TopLogprobs = list[tuple[float, int]]


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    # Multi-turn session (OpenSessionReq): the input becomes the previous turn's prompt and
    # outputs followed by input_ids. session_rid names the turn to continue (None = the last).
    session_id: str | None = None
    session_rid: str | None = None


@dataclass
class PrefilledReq:
    """A generation request whose prompt a prefill scheduler already computed (prefill/decode
    disaggregation): what a decode scheduler needs to continue it without recomputing.

    Invariants: `output_ids` holds the first sampled token (exactly one); `kv` is the prompt's
    KV as a CPU tensor [layers, 2 (K, V), len(req.input_ids), kv_heads, head_dim] in the
    model's dtype; the logprob lists are the request's state after its prefill (input
    logprobs complete, one output entry when return_logprob).
    """

    req: TokenizedGenerateReqInput
    output_ids: list[int]
    kv: Any
    cached_tokens: int = 0
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass
class TokenizedEmbeddingReqInput:
    rid: str
    input_ids: list[int]
    input_text: str | None = None


@dataclass
class AbortReq:
    """Abort the request whose rid equals `rid` (or starts with `rid` + "_"), or all."""

    rid: str = ""
    abort_all: bool = False
    message: str = "Aborted by the client"


# Control messages. Each carries a `call_id` that the loop copies into its reply, so callers
# with several calls in flight (the gRPC servicer) can match replies to requests.


@dataclass
class FlushCacheReq:
    call_id: int = 0


@dataclass
class FlushCacheOutput:
    success: bool
    message: str = ""
    call_id: int = 0


@dataclass
class GetLoadReq:
    call_id: int = 0


@dataclass
class LoadReport:
    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    cache_hit_rate: float = 0.0
    token_usage: float = 0.0
    max_running_requests: int = 0
    num_retracted_reqs: int = 0  # retracted requests waiting to be prefilled again
    num_grammar_queue_reqs: int = 0  # constrained requests waiting for their grammar
    call_id: int = 0


@dataclass
class OpenSessionReq:
    """Open a multi-turn session. capacity_of_str_len: most tokens (prompt + outputs) one
    turn's request may hold, 0 = the context length; session_id None = make one."""

    capacity_of_str_len: int = 0
    session_id: str | None = None
    call_id: int = 0


@dataclass
class OpenSessionOutput:
    session_id: str | None
    success: bool
    message: str = ""
    call_id: int = 0


@dataclass
class CloseSessionReq:
    session_id: str
    call_id: int = 0


@dataclass
class CloseSessionOutput:
    session_id: str
    success: bool
    message: str = ""
    call_id: int = 0


@dataclass
class ReqTimes:
    """Wall-clock times (time.time(), seconds) of a request's phases inside the scheduler,
    for tracing spans and the queue-time metric; 0.0 = not reached (yet)."""

    arrival: float = 0.0  # entered the scheduler loop
    scheduled: float = 0.0  # first picked into a prefill batch
    first_token: float = 0.0
    finished: float = 0.0


@dataclass
class LogprobDelta:
    """One request's logprobs in one delta (SGLang's meta_info logprob lists).

    Input entries are sent once, with the first delta after the prompt's logprobs are complete:
    entry k is about prompt token `input_token_ids[k]`; the first prompt token has no logprob
    (None, and an empty top / token-id row). Output entry k is about the delta's output id k."""

    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)

    def extend(self, later: LogprobDelta) -> None:
        """Append a later delta's entries (every list concatenates)."""
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(later, name))


@dataclass
class TokenDelta:
    """One request's output in one engine step.

    `output_ids`: the new tokens since the request's last delta. Counts are totals so far.
    `logprobs` is None when the request asked for none. `prompt_tail_ids`: the last prompt ids
    (<= 5) on the request's first delta, empty afterwards — the detokenizer's surround window
    (a session turn's prompt is only known in the loop)."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    retraction_count: int = 0
    logprobs: LogprobDelta | None = None
    prompt_tail_ids: list[int] = field(default_factory=list)
    times: ReqTimes | None = None

    def absorb(self, later: TokenDelta) -> None:
        """Fold a later delta of the same request into this one (a running total): ids and
        logprobs concatenate; counts, finish reason and times are the later ones."""
        self.output_ids.extend(later.output_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = LogprobDelta()
            self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason
        self.prompt_tokens = later.prompt_tokens
        self.completion_tokens = later.completion_tokens
        self.cached_tokens = later.cached_tokens
        self.retraction_count = later.retraction_count
        self.times = later.times or self.times


@dataclass
class BatchTokenIDOut:
    """One engine step's outputs: a TokenDelta per request that emits, in step order."""

    deltas: list[TokenDelta] = field(default_factory=list)


@dataclass
class EmbeddingOut:
    """One request's embedding (finish_reason LENGTH, or ABORT with no embedding)."""

    rid: str
    embedding: list[float]
    prompt_tokens: int
    finish_reason: FinishReason
    cached_tokens: int = 0


@dataclass
class BatchEmbeddingOut:
    results: list[EmbeddingOut] = field(default_factory=list)


# What goes through the SchedulerPort: inputs from the outside, outputs per step (tokens,
# embeddings, and on a prefill scheduler the handed-over requests), replies to control calls.
InputMessage = (
    TokenizedGenerateReqInput
    | PrefilledReq
    | TokenizedEmbeddingReqInput
    | AbortReq
    | FlushCacheReq
    | GetLoadReq
    | OpenSessionReq
    | CloseSessionReq
)
OutputMessage = BatchTokenIDOut | BatchEmbeddingOut | PrefilledReq
ControlOutput = FlushCacheOutput | LoadReport | OpenSessionOutput | CloseSessionOutput
