"""GenerateStream end to end between the gateway's client (meshlm.gateway.generate_mux through
TokenizerPool) and the REAL tokenizer service, with the real detokenizer and a scripted scheduler
(tokenizer_ring.py): concurrent requests share one call and each gets exactly its own output; bad
input fails its request before any output; cancelling a stream, or its deadline passing, aborts
its request at the scheduler; a tokenizer without GenerateStream (an older release) is served by
a Generate call per request; a tokenizer that goes away fails its streams with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from meshlm.common.errors import ServiceError
from meshlm.gateway.generate_mux import MuxStream
from meshlm.gateway.grpc_client import CallStream, TokenizerPool
from meshlm.tokenizer import service
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.v1 import common_pb2, tokenizer_pb2

from .tokenizer_ring import Ring, ring, ring_ready, text_prompt, wait_for


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


def request(rid: str, n: int, **kw) -> tokenizer_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_new_tokens=n, **kw)
    return tokenizer_pb2.GenerateRequest(rid=rid, prompts=[text_prompt("Hi")], stream=True, sampling_params=sp)


async def text_of(stream) -> str:
    return "".join([r.text async for r in stream])


@contextlib.asynccontextmanager
async def pooled(tok: HFTokenizer, long_outputs: bool = False) -> AsyncIterator[tuple[Ring, TokenizerPool]]:
    """A ready ring and the gateway's TokenizerPool on its tokenizer; `long_outputs`: the
    scheduler emits 50x its script at 50 tokens/s (requests that outlive the test's actions)."""
    async with ring(tok) as r:
        await ring_ready(r)
        if long_outputs:
            r.schedulers[0].tokens = r.tokens * 50
            r.schedulers[0].step_s = 0.02
        pool = TokenizerPool([f"127.0.0.1:{r.server.port}"])
        try:
            yield r, pool
        finally:
            await pool.close()


def test_concurrent_requests_share_one_call_and_each_gets_its_own_output(tok) -> None:
    async def run() -> None:
        async with pooled(tok) as (r, pool):
            r.schedulers[0].step_s = 0.01
            lengths = [3, 5, 7, 4, 6, 2]
            streams = await asyncio.gather(
                *(pool.generate(request(f"r{i}", n), timeout=30) for i, n in enumerate(lengths))
            )
            assert all(isinstance(s, MuxStream) for s in streams)
            calls = {id(s._call) for s in streams}
            assert len(calls) == 1  # one GenerateStream call carries them all
            texts = await asyncio.gather(*(text_of(s) for s in streams))
            assert texts == [tok.decode(r.tokens[:n]) for n in lengths]
            # the bad one fails on its own, before output, as a Generate call would
            with pytest.raises(ServiceError) as exc:
                await pool.generate(request("bad", 4, temperature=-1.0), timeout=30)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in exc.value.message
            again = await pool.generate(request("after", 3), timeout=30)
            assert await text_of(again) == tok.decode(r.tokens[:3])

    asyncio.run(run())


def test_cancel_and_deadline_abort_the_request_at_the_scheduler(tok) -> None:
    async def run() -> None:
        async with pooled(tok, long_outputs=True) as (r, pool):
            fake = r.schedulers[0]
            cancelled = await pool.generate(request("cancelled", 200), timeout=30)
            other = await pool.generate(request("other", 6), timeout=30)
            cancelled.cancel()
            await wait_for(lambda: any(a.rid == "cancelled" for a in fake.seen.aborts))
            assert [x async for x in cancelled] == []  # a cancelled stream just ends
            assert await text_of(other) == tok.decode(fake.tokens[:6])

            slow = await pool.generate(request("late", 200), timeout=0.5)
            with pytest.raises(ServiceError) as exc:
                await text_of(slow)
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for(lambda: any(a.rid == "late" for a in fake.seen.aborts))
            await wait_for(lambda: not r.manager.states)

    asyncio.run(run())


def test_request_timeout_bounds_silence_not_a_stream_whose_tokens_flow(tok) -> None:
    """Over GenerateStream a streaming request's tokens reach the call without waking its task
    (TokenizerManager.generate's sink), yet request_timeout_s still means "no output for that
    long": a request streaming for 4x the bound at 50 tokens/s completes, and one whose scheduler
    goes silent fails with DEADLINE_EXCEEDED and is aborted there."""

    async def run() -> None:
        async with ring(tok, request_timeout_s=0.3) as r:
            await ring_ready(r)
            fake = r.schedulers[0]
            fake.tokens, fake.step_s = r.tokens * 50, 0.02
            pool = TokenizerPool([f"127.0.0.1:{r.server.port}"])
            try:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                flowing = await pool.generate(request("flowing", 60), timeout=30)
                assert await text_of(flowing) == tok.decode(fake.tokens[:60])
                assert loop.time() - t0 > 1.2 - 0.1  # 60 steps of 0.02 s: well past the bound
                silent = await pool.generate(request("silent", 60), timeout=30)
                got = []
                with pytest.raises(ServiceError) as exc:
                    async for response in silent:
                        got.append(response.text)
                        if len(got) == 5:
                            fake.hold = True  # the scheduler goes silent after 5 tokens
                assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "".join(got) == tok.decode(fake.tokens[: len(got)]) and len(got) >= 5
                assert "request_timeout_s" in exc.value.message
                await wait_for(lambda: any(a.rid == "silent" for a in fake.seen.aborts))
            finally:
                await pool.close()

    asyncio.run(run())


def test_parallel_samples_stream_each_output_once_and_no_warmup(tok) -> None:
    """n=3 over GenerateStream: the prefix warm-up runs first and shows nowhere in the stream;
    each output's deltas (delivered straight from the BatchStrOut callback) and its last response
    make its text exactly once, in order, ending with its own id."""

    async def run() -> None:
        async with pooled(tok) as (r, pool):
            req = request("par", 4)
            req.sampling_params.n = 3
            stream = await pool.generate(req, timeout=30)
            responses = [x async for x in stream]
            assert sorted({x.index for x in responses}) == [0, 1, 2]
            for i in range(3):
                mine = [x for x in responses if x.index == i]
                assert "".join(x.text for x in mine) == tok.decode(r.tokens[:4])
                assert [x.finished for x in mine] == [False] * (len(mine) - 1) + [True]
                assert mine[-1].meta_info.id == f"par_{i}"
            seen = [g.rid for g in r.schedulers[0].seen.generate]
            assert seen[0] == "par_warmup_0" and set(seen[1:]) == {f"par_{i}" for i in range(3)}

    asyncio.run(run())


@pytest.mark.parametrize("with_text", [False, True])
def test_streamed_logprobs_carry_token_text_only_when_asked(tok, with_text: bool) -> None:
    """Every response of a streaming logprob request over GenerateStream, the ones its sink
    takes as much as the last one it yields, has the token texts only with
    return_text_in_logprobs."""

    async def run() -> None:
        async with pooled(tok) as (r, pool):
            req = request("lp", 6)
            req.return_logprob = True
            req.return_text_in_logprobs = with_text
            stream = await pool.generate(req, timeout=30)
            responses = [x async for x in stream]
            assert len(responses) >= 2
            lps = [e for x in responses for e in x.meta_info.logprobs.output_token_logprobs]
            assert [e.token_id for e in lps] == r.tokens[:6]
            assert all(bool(e.text) == with_text for e in lps)

    asyncio.run(run())


def test_a_tokenizer_without_generate_stream_gets_a_generate_call_each(tok, monkeypatch) -> None:
    async def unimplemented(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # pragma: no cover (an async generator, as the real handler)

    monkeypatch.setattr(service.TokenizerServicer, "GenerateStream", unimplemented)

    async def run() -> None:
        async with pooled(tok) as (r, pool):
            streams = [await pool.generate(request(f"old{i}", 4), timeout=30) for i in range(2)]
            assert all(isinstance(s, CallStream) for s in streams)
            assert not pool.endpoints()[0].mux_supported
            assert [await text_of(s) for s in streams] == [tok.decode(r.tokens[:4])] * 2

    asyncio.run(run())


def test_a_tokenizer_that_goes_away_fails_its_streams_with_unavailable(tok) -> None:
    async def run() -> None:
        async with pooled(tok, long_outputs=True) as (r, pool):
            streams = [await pool.generate(request(f"gone{i}", 200), timeout=30) for i in range(3)]
            await r.server.stop(0)
            for s in streams:
                with pytest.raises(ServiceError) as exc:
                    await text_of(s)
                assert exc.value.code == grpc.StatusCode.UNAVAILABLE
                assert f"127.0.0.1:{r.server.port}" in exc.value.message

    asyncio.run(run())
