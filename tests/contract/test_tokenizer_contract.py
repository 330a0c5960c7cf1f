"""Contract tests of meshlm.v1.TokenizerService over real gRPC.

Peers: the REAL detokenizer service (services/detokenizer) and a scripted SchedulerService
(tokenizer_fakes.FakeScheduler, speaking the ring protocol of docs/ring.md and pushing to the real
detokenizer). Here: the tokenizer on its own, and Generate; a lost or refusing scheduler, routing,
control calls, Embed, the process and the full ring with the REAL scheduler are in
test_tokenizer_ring_contract.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.v1 import common_pb2, tokenizer_pb2

from .tokenizer_ring import CODE, chat_prompt, gen_list, ring, ring_ready, text_prompt, wait_for


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


# ---- tokenizer only ------------------------------------------------------------------------


def test_tokenize_detokenize_health_reflection(tok, smollm_tokenizer):
    async def run():
        async with ring(tok, schedulers=0, detokenizer=False) as r:
            out = await r.stub.Tokenize(tokenizer_pb2.TokenizeRequest(prompt=text_prompt("Hello world")))
            assert list(out.tokens) == smollm_tokenizer.encode("Hello world") and out.count == len(out.tokens)
            assert out.max_model_len == 8192  # tokenizer_config model_max_length until a scheduler reports
            msgs = [{"role": "user", "content": "Hi"}]
            chat = await r.stub.Tokenize(tokenizer_pb2.TokenizeRequest(prompt=chat_prompt(("user", "Hi"))))
            want = smollm_tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            want = want["input_ids"] if hasattr(want, "keys") else want
            assert list(chat.tokens) == list(want)
            ids = await r.stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(
                    prompt=tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=[1, 2, 3]))
                )
            )
            assert list(ids.tokens) == [1, 2, 3]

            d = await r.stub.Detokenize(tokenizer_pb2.DetokenizeRequest(tokens=[1] + out.tokens[:]))
            assert d.text == "Hello world"
            d = await r.stub.Detokenize(
                tokenizer_pb2.DetokenizeRequest(tokens=[1] + out.tokens[:], skip_special_tokens=False)
            )
            assert d.text == "<|im_start|>Hello world"

            # Without a scheduler or a detokenizer the tokenizer answers, but is not ready.
            health = health_pb2_grpc.HealthStub(r.channel)
            for service in ("", "meshlm.v1.TokenizerService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

            refl = reflection_pb2_grpc.ServerReflectionStub(r.channel)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names = []
            async for resp in refl.ServerReflectionInfo(ask()):
                names = [s.name for s in resp.list_services_response.service]
            assert "meshlm.v1.TokenizerService" in names and "grpc.health.v1.Health" in names

    asyncio.run(run())


def test_validation_errors_are_invalid_argument_and_name_the_field(tok):
    async def run():
        async with ring(tok, schedulers=0, detokenizer=False) as r:
            cases = [
                (dict(), "prompts is empty"),
                (dict(prompts=[text_prompt("")]), "prompts[0].text is empty"),
                (
                    dict(prompts=[tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=[1, 99999]))]),
                    "prompts[0].input_ids[1] = 99999 is out of the vocabulary; token ids must be in [0, 49152)",
                ),
                (
                    dict(
                        prompts=[text_prompt("x")],
                        sampling_params=common_pb2.SamplingParams(top_p=1.5),
                    ),
                    "sampling_params.top_p must be in (0, 1], got 1.5",
                ),
                (
                    dict(prompts=[text_prompt("x")], sampling_params=common_pb2.SamplingParams(n=0)),
                    "sampling_params.n must be in [1, 128]",
                ),
            ]
            for kw, message in cases:
                e = await r.error(r.generate(**kw))
                assert e.code() == CODE.INVALID_ARGUMENT, (kw, e)
                assert message in e.details(), (message, e.details())
            e = await r.error(r.stub.Detokenize(tokenizer_pb2.DetokenizeRequest(tokens=[-3])))
            assert e.code() == CODE.INVALID_ARGUMENT and "tokens[0] = -3" in e.details()
            e = await r.error(r.stub.Tokenize(tokenizer_pb2.TokenizeRequest()))
            assert e.code() == CODE.INVALID_ARGUMENT and "prompt: set exactly one of" in e.details()
            e = await r.error(r.stub.Abort(tokenizer_pb2.AbortRequest()))
            assert e.code() == CODE.INVALID_ARGUMENT and "rid is empty" in e.details()

    asyncio.run(run())


def test_unavailable_when_no_peer_is_reachable(tok):
    async def run():
        async with ring(tok, schedulers=0, detokenizer=False, connect_timeout_s=0.5) as r:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            e = await r.error(r.generate(prompts=[text_prompt("hi")]))
            assert e.code() == CODE.UNAVAILABLE and "no detokenizer reachable" in e.details()
            assert "connect_timeout_s=0.5" in e.details()
            assert loop.time() - t0 < 3.0
            e = await r.error(r.stub.GetModelInfo(common_pb2.GetModelInfoRequest()))
            assert e.code() == CODE.UNAVAILABLE
            e = await r.error(r.stub.OpenSession(tokenizer_pb2.OpenSessionRequest()))
            assert e.code() == CODE.UNAVAILABLE
        async with ring(tok, schedulers=0, detokenizer=True, connect_timeout_s=0.5) as r:
            e = await r.error(r.generate(prompts=[text_prompt("hi")]))
            assert e.code() == CODE.UNAVAILABLE and "no scheduler reachable" in e.details(), e.details()
            info = await r.stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest())
            assert info.tokenizer_id == r.manager.origin and json.loads(info.config_json)["scheduler_endpoints"]

    asyncio.run(run())


# ---- with the real detokenizer and scripted schedulers --------------------------------------


def test_generate_stream_and_non_stream(tok):
    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            want = tok.decode(r.tokens[:5])
            trace = common_pb2.TraceContext(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
            out = await r.generate(
                prompts=[text_prompt("Hi")],
                rid="req1",
                stream=True,
                trace=trace,
                sampling_params=common_pb2.SamplingParams(max_new_tokens=5),
            )
            assert len(out) >= 2 and all(o.index == 0 for o in out)
            assert "".join(o.text for o in out) == want
            assert [i for o in out for i in o.output_ids] == r.tokens[:5]
            assert [o.finished for o in out] == [False] * (len(out) - 1) + [True]
            last = out[-1].meta_info
            assert last.id == "req1" and last.finish_reason.type == common_pb2.FINISH_TYPE_LENGTH
            assert last.completion_tokens == 5 and last.prompt_tokens == len(tok.encode("Hi"))
            assert last.e2e_latency > 0
            sent = r.schedulers[0].seen.generate[-1]
            assert sent.rid == "req1" and sent.origin == r.manager.origin and sent.stream
            assert sent.trace.traceparent.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"  # same trace
            assert r.schedulers[0].seen.origins == [r.manager.origin]

            whole = await r.generate(
                prompts=[text_prompt("Hi")],
                stream=False,
                sampling_params=common_pb2.SamplingParams(max_new_tokens=5),
            )
            assert len(whole) == 1 and whole[0].finished and whole[0].text == want
            assert list(whole[0].output_ids) == r.tokens[:5]

            # chat messages go through the template
            await r.generate(
                prompts=[chat_prompt(("system", "Be brief."), ("user", "Hi"))],
                sampling_params=common_pb2.SamplingParams(max_new_tokens=1),
            )
            want_text, want_ids = tok.chat_ids(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            )
            sent = r.schedulers[0].seen.generate[-1]
            assert list(sent.input_ids) == want_ids and sent.input_text == want_text

            m = r.manager.metrics.metrics.registry
            assert m.get_sample_value("meshlm:num_requests_total") == 3
            assert m.get_sample_value("meshlm:generation_tokens_total") == 11
            assert m.get_sample_value("meshlm:time_to_first_token_seconds_count") == 3
            assert m.get_sample_value("meshlm:inter_token_latency_seconds_count") >= 4

    asyncio.run(run())


def test_batch_and_n_fan_out_with_prefix_warmup(tok):
    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            out = await r.generate(
                prompts=[text_prompt("a"), text_prompt("b")],
                rid="bn",
                stream=False,
                sampling_params=common_pb2.SamplingParams(n=2, max_new_tokens=3),
            )
            assert sorted(o.index for o in out) == [0, 1, 2, 3]
            assert {o.index: o.meta_info.id for o in out} == {
                0: "bn_0",
                1: "bn_1",
                2: "bn_2",
                3: "bn_3",
            }
            assert all(o.text == tok.decode(r.tokens[:3]) for o in out)
            seen = [g.rid for g in r.schedulers[0].seen.generate]
            assert set(seen[:2]) == {"bn_warmup_0", "bn_warmup_1"} and set(seen[2:]) == {f"bn_{i}" for i in range(4)}
            warm = r.schedulers[0].seen.generate[0]
            assert warm.sampling_params.max_new_tokens == 0
            for g in r.schedulers[0].seen.generate[2:]:
                assert not g.sampling_params.HasField("n")
                prompt = "a" if g.rid in ("bn_0", "bn_1") else "b"
                assert list(g.input_ids) == tok.encode(prompt)

            streamed = await r.generate(
                prompts=[text_prompt("a")],
                rid="s",
                stream=True,
                sampling_params=common_pb2.SamplingParams(n=3, max_new_tokens=2),
            )
            for i in range(3):
                assert "".join(o.text for o in streamed if o.index == i) == tok.decode(r.tokens[:2])
                assert [o for o in streamed if o.index == i][-1].meta_info.id == f"s_{i}"

    asyncio.run(run())


def test_resent_deltas_are_dropped(tok):
    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            r.schedulers[0].resend_at_end = True
            out = await r.generate(
                prompts=[text_prompt("Hi")],
                stream=True,
                sampling_params=common_pb2.SamplingParams(max_new_tokens=6),
            )
            assert "".join(o.text for o in out) == tok.decode(r.tokens[:6])
            assert [i for o in out for i in o.output_ids] == r.tokens[:6]

    asyncio.run(run())


def test_logprobs_follow_ids_and_text_is_optional(tok):
    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            for with_text in (False, True):
                out = await r.generate(
                    prompts=[text_prompt("Hi")],
                    stream=False,
                    return_logprob=True,
                    return_text_in_logprobs=with_text,
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=4),
                )
                lps = out[0].meta_info.logprobs.output_token_logprobs
                assert [e.token_id for e in lps] == r.tokens[:4]
                assert all(bool(e.text) == with_text for e in lps)

    asyncio.run(run())


def test_abort_finish_reasons_map_to_status_codes(tok):
    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            fake = r.schedulers[0]
            for status, code in (
                (400, CODE.INVALID_ARGUMENT),
                (404, CODE.NOT_FOUND),
                (503, CODE.RESOURCE_EXHAUSTED),
                (500, CODE.INTERNAL),
            ):
                fake.reject = (status, f"reason {status}")
                e = await r.error(r.generate(prompts=[text_prompt("Hi")], stream=True))
                assert e.code() == code and f"reason {status}" in e.details()
            fake.reject = (503, "The request queue is full.")  # an Embed the loop rejects fails too
            e = await r.error(r.stub.Embed(tokenizer_pb2.EmbedRequest(prompts=[text_prompt("Hi")]), timeout=5))
            assert e.code() == CODE.RESOURCE_EXHAUSTED and "queue is full" in e.details()
            fake.reject = None
            fake.direct_error = (503, "no detokenizer reachable")  # RequestError on Connect
            e = await r.error(r.generate(prompts=[text_prompt("Hi")]))
            assert e.code() == CODE.RESOURCE_EXHAUSTED and "no detokenizer reachable" in e.details()
            fake.direct_error = None
            assert r.manager.states == {}

    asyncio.run(run())


def test_cancel_and_abort_reach_the_scheduler(tok):
    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            fake = r.schedulers[0]
            fake.hold = True
            call = r.stub.Generate(tokenizer_pb2.GenerateRequest(prompts=[text_prompt("Hi")], rid="gone", stream=True))
            await wait_for(lambda: any(g.rid == "gone" for g in fake.seen.generate))
            call.cancel()
            await wait_for(lambda: any(a.rid == "gone" for a in fake.seen.aborts))
            await wait_for(lambda: r.manager.states == {})

            # n>1: a cancelled call aborts every sample
            call = r.stub.Generate(
                tokenizer_pb2.GenerateRequest(
                    prompts=[text_prompt("Hi")], rid="many", stream=True, sampling_params=common_pb2.SamplingParams(n=2)
                )
            )
            await wait_for(lambda: {g.rid for g in fake.seen.generate} >= {"many_0", "many_1"})
            call.cancel()
            await wait_for(lambda: {a.rid for a in fake.seen.aborts} >= {"many_0", "many_1"})
            await wait_for(lambda: r.manager.states == {})
            assert r.manager.metrics.metrics.registry.get_sample_value("meshlm:num_aborted_requests_total") == 3

            # Abort RPC by rid prefix: the scheduler aborts both samples, the call ends CANCELLED
            call = r.stub.Generate(
                tokenizer_pb2.GenerateRequest(
                    prompts=[text_prompt("Hi")], rid="ab", sampling_params=common_pb2.SamplingParams(n=2)
                )
            )
            await wait_for(lambda: {g.rid for g in fake.seen.generate} >= {"ab_0", "ab_1"})
            await r.stub.Abort(tokenizer_pb2.AbortRequest(rid="ab"))
            e = await r.error(gen_list(call))
            assert e.code() == CODE.CANCELLED and "aborted" in e.details()
            assert {a.rid for a in fake.seen.aborts} >= {"ab_0", "ab_1"}

    asyncio.run(run())


def test_no_output_within_request_timeout_is_deadline_exceeded(tok):
    async def run():
        async with ring(tok, request_timeout_s=0.5) as r:
            await ring_ready(r)
            fake = r.schedulers[0]
            fake.hold = True
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            e = await r.error(r.generate(prompts=[text_prompt("Hi")], rid="slow"))
            assert e.code() == CODE.DEADLINE_EXCEEDED and "request_timeout_s=0.5" in e.details()
            assert loop.time() - t0 < 5
            await wait_for(lambda: any(a.rid == "slow" for a in fake.seen.aborts))
            await wait_for(lambda: r.manager.states == {})

    asyncio.run(run())
