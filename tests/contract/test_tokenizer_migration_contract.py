"""Contract of request migration at the tokenizer (docs/ring.md "Request migration"): when the
scheduler serving a request is lost after it produced output, the request moves to another one as
`<rid>_m1` with the ids (and logprobs) already received, and the caller's stream continues with
no gap and no duplicate; `migration_limit` bounds the moves (0: the request fails with
UNAVAILABLE as before). Peers: the REAL detokenizer and scripted schedulers
(tokenizer_fakes.FakeScheduler, which continue a resumed request the way the real scheduler does:
tests/contract/test_scheduler_resume_contract.py)."""

from __future__ import annotations

import asyncio

import pytest

from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.v1 import common_pb2, tokenizer_pb2

from .tokenizer_ring import CODE, Ring, gen_list, ring, ring_ready, text_prompt, wait_for


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


async def start_and_kill(r: Ring, rid: str, after: int, **kw):
    """A streaming Generate; once `after` responses arrived, the scheduler serving it stops.
    Returns (responses so far, the call, the lost fake, the other fake)."""
    for f in r.schedulers:
        f.step_s = 0.15
    call = r.stub.Generate(
        tokenizer_pb2.GenerateRequest(prompts=[text_prompt("Hi")], rid=rid, stream=True, **kw), timeout=20
    )
    got = [await call.read() for _ in range(after)]
    lost = next(f for f in r.schedulers if any(g.rid == rid for g in f.seen.generate))
    await lost.stop(0)
    others = [f for f in r.schedulers if f is not lost]
    return got, call, lost, others


def test_a_stream_whose_scheduler_dies_continues_on_another_without_gap_or_duplicate(tok):
    async def run():
        async with ring(tok, schedulers=2) as r:
            await ring_ready(r)
            got, call, lost, (other,) = await start_and_kill(r, "mig", 3, return_logprob=True)
            got += await gen_list(call)
            assert "".join(g.text for g in got) == tok.decode(r.tokens)
            assert [i for g in got for i in g.output_ids] == r.tokens
            lps = [t for g in got for t in g.meta_info.logprobs.output_token_logprobs]
            assert [t.token_id for t in lps] == r.tokens  # one entry per id, in order (fake: -0.5 - k)
            assert [round(t.logprob, 3) for t in lps] == [-0.5 - k for k in range(len(r.tokens))]
            last = got[-1].meta_info
            assert got[-1].finished and last.id == "mig" and last.completion_tokens == len(r.tokens)
            assert last.finish_reason.type == common_pb2.FINISH_TYPE_LENGTH
            moved = next(g for g in other.seen.generate if g.rid == "mig_m1")
            k = len(moved.resumed.output_ids)
            assert k >= 3 and list(moved.resumed.output_ids) == r.tokens[:k]
            assert [t.token_id for t in moved.resumed.logprobs.output_token_logprobs] == r.tokens[:k]
            first = next(g for g in lost.seen.generate if g.rid == "mig")
            assert moved.sampling_params == first.sampling_params  # the scheduler counts the resumed ids
            assert list(moved.input_ids) == list(first.input_ids)
            assert r.manager.metrics.num_migrated_requests._value.get() == 1
            await wait_for(lambda: not r.manager.states)

            # Non-streaming: the one response holds the whole output.
            call = r.stub.Generate(tokenizer_pb2.GenerateRequest(prompts=[text_prompt("Hi")], rid="mig-ns"), timeout=20)
            await wait_for(lambda: any(g.rid == "mig-ns" for g in other.seen.generate))
            await asyncio.sleep(0.6)  # a few tokens delivered
            assert r.manager.states["mig-ns"].received.ids
            # ... and no scheduler left to move to: it fails, naming why.
            await other.stop(0)
            e = await r.error(gen_list(call))
            assert e.code() == CODE.UNAVAILABLE and "connection lost" in e.details()
            assert "no other scheduler is connected" in e.details()

    asyncio.run(run())


def test_migration_limit_bounds_the_moves(tok):
    async def run():
        async with ring(tok, schedulers=3) as r:
            await ring_ready(r)
            _, call, _, others = await start_and_kill(r, "twice", 2)
            await wait_for(lambda: any(g.rid == "twice_m1" for f in others for g in f.seen.generate))
            second = next(f for f in others if any(g.rid == "twice_m1" for g in f.seen.generate))
            await second.stop(0)  # limit 1: the second loss fails the request
            e = await r.error(gen_list(call))
            assert e.code() == CODE.UNAVAILABLE and "migration_limit=1" in e.details(), e.details()

    asyncio.run(run())


def test_migration_limit_0_fails_the_stream_with_unavailable(tok):
    async def run():
        async with ring(tok, schedulers=2, migration_limit=0) as r:
            await ring_ready(r)
            got, call, _, (other,) = await start_and_kill(r, "nomig", 2)
            e = await r.error(gen_list(call))
            assert e.code() == CODE.UNAVAILABLE and "connection lost" in e.details()
            assert "migration_limit=0" in e.details()
            assert got and not any(g.rid.startswith("nomig_") for g in other.seen.generate)
            await wait_for(lambda: not r.manager.states)

    asyncio.run(run())
