"""A caller of the public Generate stream that does not read (issue 12 part 5): its undelivered
output is bounded by --max-stream-backlog-bytes, past which its request is aborted at the
scheduler (AbortReq) and the call ends with RESOURCE_EXHAUSTED; a caller that reads meanwhile is
untouched. Peers as in test_tokenizer_contract.py: the REAL detokenizer and a scripted scheduler."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from .tokenizer_ring import CODE, gen_list, ring, ring_ready, text_prompt, wait_for

BACKLOG = 16384


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


def test_a_caller_that_does_not_read_is_aborted_and_others_are_untouched(tok):
    async def run():
        async with ring(tok, max_stream_backlog_bytes=BACKLOG) as r:
            await ring_ready(r)
            fake = r.schedulers[0]
            fake.tokens = r.tokens * 1000  # far more output than gRPC's buffers and the bound hold
            fake.step_s = 0.0005
            # Without BDP probing the client's HTTP/2 window stays at 64 KiB, so gRPC's own buffers fill
            # quickly (with it they grow to a few MiB: bounded too, but slow to fill in a test).
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.server.port}", options=[("grpc.http2.bdp_probe", 0)])
            slow = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(
                tokenizer_pb2.GenerateRequest(
                    rid="slow",
                    prompts=[text_prompt("Hi")],
                    stream=True,
                    return_logprob=True,
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=len(fake.tokens)),
                ),
                timeout=120,
            )
            await wait_for(lambda: any(g.rid == "slow" for g in fake.seen.generate))
            # A caller that reads is served while the slow one backs up.
            fast = await r.generate(
                rid="fast",
                prompts=[text_prompt("Hi")],
                stream=True,
                sampling_params=common_pb2.SamplingParams(max_new_tokens=6),
            )
            assert "".join(m.text for m in fast) == tok.decode(fake.tokens[:6])
            assert fast[-1].finished

            # The slow call is aborted at the scheduler long before its output would end.
            await wait_for(lambda: any(a.rid == "slow" for a in fake.seen.aborts), timeout=60)
            assert "slow" not in r.manager.states
            calls = [c for c in r.manager.inflight.calls if c.rid == "slow"]
            assert all(c.queue.nbytes <= BACKLOG for c in calls)

            # Reading now gives what gRPC had buffered, then the error naming the bound.
            with pytest.raises(Exception) as exc:
                await gen_list(slow)
            err = exc.value
            assert err.code() == CODE.RESOURCE_EXHAUSTED, err
            assert "did not read its stream" in err.details() and "max_stream_backlog_bytes" in err.details()
            await wait_for(lambda: not r.manager.inflight.calls)
            await channel.close()

            # And the replica still serves.
            again = await r.generate(
                rid="after", prompts=[text_prompt("Hi")], sampling_params=common_pb2.SamplingParams(max_new_tokens=4)
            )
            assert again[-1].text == tok.decode(fake.tokens[:4])

    asyncio.run(run())
