"""Request migration's rules at the tokenizer (migration.py, state.Received) and its flag:
--migration-limit on the tokenizer (default 1, env, >= 0) and on `meshlm launch`."""

from __future__ import annotations

import pytest

from meshlm.launch.cli import build_parser
from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.migration import MigrationPolicy
from meshlm.tokenizer.state import Call, ReqKind, ReqState
from meshlm.v1 import common_pb2, scheduler_pb2


def state(kind: ReqKind = ReqKind.GENERATE, **req) -> ReqState:
    pb = scheduler_pb2.TokenizedGenerateReqInput(rid="r", input_ids=[1, 2], **req)
    return ReqState(Call("r", request_timeout_s=300.0), 0, "r", pb, conn=None, kind=kind)


def lp(token_id: int, text: str = "") -> common_pb2.LogprobDelta:
    d = common_pb2.LogprobDelta()
    d.output_token_logprobs.add(token_id=token_id, logprob=-0.25, has_logprob=True, text=text)
    d.output_top_logprobs.add().entries.add(token_id=token_id, logprob=-0.25, text=text)
    return d


def test_prepare_resumes_with_what_was_received_under_a_new_wire_rid() -> None:
    s = state(return_logprob=True, top_logprobs_num=1)
    s.cached_tokens = 2
    for t in (5, 6):
        s.received.record([t], lp(t, text=f"t{t}"), want_logprobs=True)
    policy = MigrationPolicy(limit=1)
    assert policy.refusal(s) is None
    assert policy.prepare(s) == "r_m1" and s.migrations == 1
    resumed = s.req.resumed
    assert list(resumed.output_ids) == [5, 6] and resumed.cached_tokens == 2
    assert [e.token_id for e in resumed.logprobs.output_token_logprobs] == [5, 6]
    assert all(not e.text for e in resumed.logprobs.output_token_logprobs)  # values and ids only
    assert len(resumed.logprobs.output_top_logprobs) == 2
    assert s.received.logprobs.output_token_logprobs[0].text == "t5"  # the record itself is untouched
    assert "migration_limit=1" in (policy.refusal(s) or "")  # the limit counts moves


def test_refusals_name_why() -> None:
    assert "migration_limit=0" in (MigrationPolicy(0).refusal(state()) or "")
    assert "only generate" in (MigrationPolicy(1).refusal(state(ReqKind.EMBED)) or "")
    assert "session" in (MigrationPolicy(1).refusal(state(session_id="s")) or "")
    s = state(return_logprob=True)
    s.received.record([5], None, want_logprobs=True)  # an id without its logprob
    assert "logprobs" in (MigrationPolicy(1).refusal(s) or "")
    plain = state()
    plain.received.record([5], lp(5), want_logprobs=False)  # not kept when not asked for
    assert not plain.received.logprobs.output_token_logprobs and MigrationPolicy(1).refusal(plain) is None


def test_the_flag_on_the_tokenizer_and_on_launch() -> None:
    assert TokenizerConfig().migration_limit == 1
    assert TokenizerConfig.from_env({"MESHLM_TOKENIZER_MIGRATION_LIMIT": "0"}).migration_limit == 0
    with pytest.raises(ValueError, match="migration_limit must be >= 0"):
        TokenizerConfig(migration_limit=-1)
    parser = build_parser()
    assert parser.parse_args(["launch"]).migration_limit == 1
    assert parser.parse_args(["launch", "--migration-limit", "3"]).migration_limit == 3
