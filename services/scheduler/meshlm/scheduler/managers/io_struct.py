"""Messages into and out of the scheduler, as plain dataclasses (SGLang's io_struct).

They carry no protobuf: the gRPC servicer converts at the edge. Output messages are batched:
one BatchTokenIDOut per engine step, with parallel lists over the requests that emit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from meshlm.scheduler.sampling.sampling_params import SamplingParams

TopLogprobs = list[tuple[float, int]]


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    stream: bool = False


@dataclass
class TokenizedEmbeddingReqInput:
    rid: str
    input_ids: list[int]
    input_text: Optional[str] = None


@dataclass
class AbortReq:
    """Abort the request whose rid equals `rid` (or starts with `rid` + "_"), or all."""

    rid: str = ""
    abort_all: bool = False
    message: str = "Aborted by the client"


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheOutput:
    success: bool
    message: str = ""


@dataclass
class GetLoadReq:
    pass


@dataclass
class LoadReport:
    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    cache_hit_rate: float = 0.0
    token_usage: float = 0.0


@dataclass
class BatchTokenIDOut:
    """One step's deltas for every request that emits this step (parallel lists)."""

    rids: list[str] = field(default_factory=list)
    finished_reasons: list[Optional[dict[str, Any]]] = field(default_factory=list)
    output_ids: list[list[int]] = field(default_factory=list)  # new tokens since the last emission
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    # Logprob deltas, empty lists for requests that did not ask. Input logprobs are sent once;
    # the first prompt token has no logprob (None).
    input_token_logprobs: list[list[Optional[float]]] = field(default_factory=list)
    input_token_ids: list[list[int]] = field(default_factory=list)
    input_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    output_token_logprobs: list[list[float]] = field(default_factory=list)
    output_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    retraction_counts: list[int] = field(default_factory=list)


@dataclass
class BatchEmbeddingOut:
    rids: list[str] = field(default_factory=list)
    embeddings: list[list[float]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    finished_reasons: list[Optional[dict[str, Any]]] = field(default_factory=list)
