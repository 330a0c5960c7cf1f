"""GrammarManager: the grammar queue of the scheduler loop (SGLang's Scheduler.grammar_queue,
handle_generate_request's grammar branch and move_ready_grammar_requests).

A request whose sampling params set json_schema, regex or ebnf is not queued for prefill at
once: `process_req_with_grammar` asks the compile pool for its key's grammar (a cache hit or a
compile on a pool thread) and parks the request here. Each loop iteration
`move_ready_grammar_requests` moves every request whose grammar is ready on, in arrival order:
it gets its own matcher (`req.grammar`, a copy of the compiled template) and continues where
its caller said (the waiting queue; a handed-over PD request: its first token is fed to the
matcher, then the transfer queue). The loop never waits for a compile.

A schema / regex / grammar the backend rejects ends the request with a BAD_REQUEST abort whose
message names the field (`sampling_params.json_schema` ...); `--grammar-backend none` refuses
every constrained request the same way; a compile still running after `timeout_s` ends it with
an INTERNAL error. Aborts reach parked requests too.

Tensor parallelism: which requests move is decided on rank 0 alone (`ready_decisions`, which
reads futures and the clock) and broadcast with the iteration's inputs; the other ranks then
wait for those same compiles on their own pools (`move_ready_grammar_requests(decisions)`), so
every rank moves the same requests in the same iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from meshlm.common.finish import AbortStatus, FinishReason
from meshlm.scheduler.constrained.base_grammar_backend import (
    FIELD_OF_KIND,
    BaseGrammarObject,
    GrammarKey,
    InvalidGrammarError,
)
from meshlm.scheduler.constrained.compile_pool import GrammarCompilePool
from meshlm.scheduler.managers.output_processor import OutputProcessor
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.sampling.sampling_params import SamplingParams

GRAMMAR_TIMEOUT_S = 300.0  # SGLang's SGLANG_GRAMMAR_TIMEOUT default
# (rid, timed out) for each request that leaves the grammar queue this iteration.
GrammarDecision = tuple[str, bool]
Continuation = Callable[[Req], None]


def grammar_key(sp: SamplingParams) -> GrammarKey | None:
    """The request's constraint as (kind, text), or None (sampling_rules allows at most one)."""
    if sp.json_schema is not None:
        return ("json", sp.json_schema)
    if sp.regex is not None:
        return ("regex", sp.regex)
    if sp.ebnf is not None:
        return ("ebnf", sp.ebnf)
    return None


@dataclass
class _Parked:
    req: Req
    key: GrammarKey
    future: Future[BaseGrammarObject]
    then: Continuation
    since: float  # time.monotonic() when parked (read on rank 0 only)


class GrammarManager:
    def __init__(
        self, backend_name: str, pool: GrammarCompilePool | None, output: OutputProcessor, timeout_s: float
    ) -> None:
        """pool: None with backend "none"; timeout_s: the longest a compile may keep a request."""
        self.backend_name = backend_name
        self.pool = pool
        self.output = output
        self.timeout_s = timeout_s
        self.grammar_queue: list[_Parked] = []

    def __len__(self) -> int:
        return len(self.grammar_queue)

    def process_req_with_grammar(self, req: Req, then: Continuation) -> bool:
        """Park req until its grammar is ready (True), or False when it has no constraint.

        A refused request (backend none) is ended here and counts as taken (True)."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return False
        if self.pool is None:
            field = FIELD_OF_KIND[key[0]]
            self.output.reject(
                req, f"sampling_params.{field}: structured output is disabled on this server (--grammar-backend none)"
            )
            return True
        self.grammar_queue.append(_Parked(req, key, self.pool.get(key), then, time.monotonic()))
        return True

    def ready_decisions(self) -> list[GrammarDecision]:
        """Rank 0's choice of the requests that leave the queue now: compiled (or failed), or
        parked longer than timeout_s."""
        now = time.monotonic()
        out: list[GrammarDecision] = []
        for p in self.grammar_queue:
            if p.future.done():
                out.append((p.req.rid, False))
            elif now - p.since > self.timeout_s:
                out.append((p.req.rid, True))
        return out

    def move_ready_grammar_requests(self, decisions: list[GrammarDecision] | None = None) -> None:
        """Move the decided requests on (None: decide here, as on a single rank)."""
        if not self.grammar_queue:
            return
        if decisions is None:
            decisions = self.ready_decisions()
        if not decisions:
            return
        chosen = dict(decisions)
        keep: list[_Parked] = []
        for p in self.grammar_queue:
            timed_out = chosen.get(p.req.rid)
            if timed_out is None:
                keep.append(p)
            elif timed_out:
                p.future.cancel()
                field = FIELD_OF_KIND[p.key[0]]
                self.output.reject(
                    p.req,
                    f"sampling_params.{field}: the grammar did not compile within {self.timeout_s:g} s",
                    AbortStatus.INTERNAL,
                )
            else:
                self._finish(p)
        self.grammar_queue = keep

    def _finish(self, p: _Parked) -> None:
        try:
            template = p.future.result()  # done on rank 0; other ranks wait for their own compile
        except InvalidGrammarError as e:
            return self.output.reject(p.req, str(e))
        except Exception as e:  # the backend itself failed (e.g. could not read the vocabulary)
            return self.output.reject(p.req, f"grammar backend {self.backend_name} failed: {e!r}", AbortStatus.INTERNAL)
        p.req.grammar = template.copy()
        p.then(p.req)

    def abort(self, hit: Callable[[str], bool], reason: FinishReason) -> None:
        """End parked requests whose rid `hit` matches (they hold no KV)."""
        for p in [p for p in self.grammar_queue if hit(p.req.rid)]:
            self.grammar_queue.remove(p)
            self.output.abort(p.req, reason)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
