"""Request migration (docs/ring.md "Request migration"): a Generate output whose scheduler is
lost after it produced output continues on another scheduler, from what the client already has.

Per request the tokenizer keeps what it received (state.Received: the output ids and, when the
request wants logprobs, their output logprobs). On migration the request goes, under a fresh
wire rid `<rid>_m<k>`, to another scheduler with the same TokenizedGenerateReqInput (prompt,
sampling params, max_new_tokens unchanged) plus `resumed` = what was received. The scheduler
takes those outputs as its own (it prefills prompt + outputs, as after a retraction, and counts
them against max_new_tokens, min_new_tokens, penalties, stop strings and seeded sampling
positions), so a greedy or seeded continuation equals the uninterrupted output. Its first delta
re-sends every output id from token offset 0 with the decode seed: the detokenizer decodes the
text from the start (its incremental state never restarts mid-text), and the tokenizer's
per-request DeltaTracker, kept across the move, clips the text and ids the client already has,
so the stream continues with no gap and no duplicate.

Invariants: a request migrates at most `migration_limit` times; only Generate outputs that
produced output and are not in a session migrate (one that produced nothing is retried once
instead, dispatch.py); `Received` holds exactly the ids the client was sent, in order, with one
output logprob entry per id when the request wants logprobs.
"""

from __future__ import annotations

from meshlm.tokenizer.state import ReqKind, ReqState, strip_logprob_text
from meshlm.v1 import scheduler_pb2


class MigrationPolicy:
    """Whether a request may migrate (`refusal`) and what it carries when it does (`prepare`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def refusal(self, state: ReqState) -> str | None:
        """Why `state` (a request that produced output) cannot migrate, or None."""
        if self.limit == 0:
            return "request migration is off (migration_limit=0)"
        if state.kind is not ReqKind.GENERATE:
            return "only generate requests migrate"
        if state.session_id:
            return "session requests stay on their scheduler"
        if state.migrations >= self.limit:
            return f"it already migrated {state.migrations} time(s) (migration_limit={self.limit})"
        if state.req.return_logprob and not state.received.logprobs_complete():
            return "its logprobs so far are incomplete"
        return None

    @staticmethod
    def prepare(state: ReqState) -> str:
        """Count the move, attach what the client has to the request, and return its new wire rid."""
        state.migrations += 1
        received = state.received
        resumed = scheduler_pb2.ResumedOutput(output_ids=received.ids, cached_tokens=state.cached_tokens)
        if state.req.return_logprob:
            resumed.logprobs.CopyFrom(received.logprobs)
            strip_logprob_text(resumed.logprobs)  # values and ids only; the detokenizer adds text
        state.req.resumed.CopyFrom(resumed)
        return f"{state.public_rid}_m{state.migrations}"
