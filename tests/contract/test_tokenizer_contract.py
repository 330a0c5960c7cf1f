"""Contract tests of meshlm.v1.TokenizerService over real gRPC.

Peers: the REAL detokenizer service (services/detokenizer) and a scripted SchedulerService
(tokenizer_fakes.FakeScheduler, speaking the ring protocol of docs/ring.md and pushing to the real
detokenizer), plus one full-ring test with the REAL scheduler service and SmolLM2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.service import start_server
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from tokenizer_fakes import FakeScheduler

CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_prompt(s: str) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(text=s)


def chat_prompt(*turns: tuple[str, str]) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(
        messages=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    )


@dataclass
class Ring:
    stub: tokenizer_pb2_grpc.TokenizerServiceStub
    channel: grpc.aio.Channel
    manager: Any
    server: Any
    schedulers: list
    tokens: list[int]

    async def generate(self, **kw) -> list[tokenizer_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(tokenizer_pb2.GenerateRequest(**kw), timeout=20)]

    async def error(self, coro) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await coro
        return exc.value


async def _gen_list(call):
    """All responses of a Generate call (read() style, so a call already read from works)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


@contextlib.asynccontextmanager
async def ring(
    tok: HFTokenizer,
    *,
    schedulers: int = 1,
    detokenizer: bool = True,
    embedding: bool = False,
    **config: Any,
):
    """Real detokenizer + `schedulers` fake schedulers + the tokenizer server, on local ports."""
    from meshlm.detokenizer.config import DetokenizerConfig
    from meshlm.detokenizer.service import start_detokenizer

    tokens = tok.encode(" The capital of France is Paris.")
    detok = None
    if detokenizer:
        detok = await start_detokenizer(
            DetokenizerConfig(tokenizer_path=str(tok.path), host="127.0.0.1", port=0, grace_period_s=1.0)
        )
        detok_addr = f"127.0.0.1:{detok.port}"
    else:
        detok_addr = f"127.0.0.1:{free_port()}"
    fakes = [FakeScheduler(f"fake-{i}", detok_addr, tokens, tokenizer_path=str(tok.path)) for i in range(schedulers)]
    for f in fakes:
        f.is_generation = not embedding
    sched_addrs = [f"127.0.0.1:{await f.start()}" for f in fakes] or [f"127.0.0.1:{free_port()}"]
    cfg = TokenizerConfig(
        host="127.0.0.1",
        port=0,
        tokenizer_path=str(tok.path),
        scheduler_addrs=tuple(sched_addrs),
        detokenizer_addrs=(detok_addr,),
        connect_timeout_s=config.pop("connect_timeout_s", 3.0),
        **config,
    )
    running = await start_server(cfg, tokenizer=tok)
    server, manager = running.server, running.manager
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    r = Ring(tokenizer_pb2_grpc.TokenizerServiceStub(channel), channel, manager, server, fakes, tokens)
    try:
        yield r
    finally:
        await channel.close()
        await running.close()
        for f in fakes:
            await f.stop(0)
        if detok is not None:
            await detok.stop(0.5)


async def wait_for(pred, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def ring_ready(r: Ring) -> None:
    await wait_for(
        lambda: len(r.manager.schedulers.connected()) == len(r.schedulers) and r.manager.detokenizers.connected()
    )


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
                    "sampling_params.n must be >= 1",
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
            e = await r.error(_gen_list(call))
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


def test_scheduler_loss_retries_idle_requests_and_fails_started_ones(tok):
    async def run():
        async with ring(tok, schedulers=2) as r:
            await ring_ready(r)
            a, b = r.schedulers
            a.hold = True
            b.hold = True
            call = r.stub.Generate(
                tokenizer_pb2.GenerateRequest(
                    prompts=[text_prompt("Hi")],
                    rid="moved",
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=3),
                )
            )
            await wait_for(lambda: any(g.rid == "moved" for g in a.seen.generate + b.seen.generate))
            lost, other = (a, b) if any(g.rid == "moved" for g in a.seen.generate) else (b, a)
            other.hold = False
            await lost.stop(0)
            out = await _gen_list(call)
            assert other.seen.generate[-1].rid == "moved_retry"
            assert out[0].meta_info.id == "moved" and out[0].text == tok.decode(r.tokens[:3])

            # a request that already produced output is not retried: UNAVAILABLE
            other.step_s = 0.3
            call = r.stub.Generate(
                tokenizer_pb2.GenerateRequest(prompts=[text_prompt("Hi")], rid="started", stream=True)
            )
            first = await call.read()
            assert first.output_ids
            await other.stop(0)
            e = await r.error(_gen_list(call))
            assert e.code() == CODE.UNAVAILABLE and "connection lost" in e.details()

    asyncio.run(run())


def test_shortest_queue_routing_uses_scheduler_loads(tok):
    async def run():
        async with ring(tok, schedulers=2, routing_policy="shortest_queue") as r:
            a, b = r.schedulers
            a.load.num_queue_reqs, a.load.num_running_reqs = 5, 3
            b.load.num_queue_reqs, b.load.num_running_reqs = 1, 1
            await ring_ready(r)
            await wait_for(lambda: r.manager.schedulers.connections[0].load.num_queue_reqs == 5)
            for _ in range(3):
                await r.generate(
                    prompts=[text_prompt("Hi")],
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=1),
                )
            assert len(b.seen.generate) == 3 and not a.seen.generate

            info = await r.stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest())
            assert {(s.scheduler_id, s.num_queue_reqs) for s in info.schedulers} == {
                ("fake-0", 5),
                ("fake-1", 1),
            }
            assert json.loads(info.config_json)["routing_policy"] == "shortest_queue"
            assert info.model.model_path == "fake-model" and info.model.tokenizer_path == str(tok.path)

    asyncio.run(run())


def test_flush_cache_sessions_and_model_info(tok):
    async def run():
        async with ring(tok, schedulers=2, served_model_name="smol") as r:
            await ring_ready(r)
            a, b = r.schedulers
            ok = await r.stub.FlushCache(tokenizer_pb2.FlushCacheRequest())
            assert ok.success and a.seen.flushes == 1 and b.seen.flushes == 1
            b.flush_ok = False
            bad = await r.stub.FlushCache(tokenizer_pb2.FlushCacheRequest())
            assert not bad.success and "fake-1" in bad.message and "requests are running" in bad.message

            info = await r.stub.GetModelInfo(common_pb2.GetModelInfoRequest())
            assert info.served_model_name == "smol" and info.context_length == 8192

            sids = [
                (await r.stub.OpenSession(tokenizer_pb2.OpenSessionRequest(capacity_of_str_len=100))).session_id
                for _ in range(2)
            ]
            assert sorted(s.split("-")[0] for s in sids) == ["s0", "s1"]
            for sid in sids:
                j = int(sid.split("-")[0][1:])
                assert sid in r.schedulers[j].seen.sessions
                await r.generate(
                    prompts=[text_prompt("Hi")],
                    session_id=sid,
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=1),
                )
                assert r.schedulers[j].seen.generate[-1].session_id == sid
            e = await r.error(r.stub.OpenSession(tokenizer_pb2.OpenSessionRequest(session_id=sids[0])))
            assert e.code() == CODE.INVALID_ARGUMENT and "already exists" in e.details()
            await r.stub.CloseSession(tokenizer_pb2.CloseSessionRequest(session_id=sids[0]))
            e = await r.error(r.stub.CloseSession(tokenizer_pb2.CloseSessionRequest(session_id=sids[0])))
            assert e.code() == CODE.NOT_FOUND and sids[0] in e.details()
            e = await r.error(r.generate(prompts=[text_prompt("Hi")], session_id="s7-nope"))
            assert e.code() == CODE.NOT_FOUND and "s7-nope" in e.details()

    asyncio.run(run())


def test_embed_and_model_kind_checks(tok):
    async def run():
        async with ring(tok, embedding=True) as r:
            await ring_ready(r)
            await wait_for(lambda: r.manager.model_info is not None)
            emb = await r.stub.Embed(tokenizer_pb2.EmbedRequest(prompts=[text_prompt("a b c"), text_prompt("d")]))
            assert [x.index for x in emb.results] == [0, 1]
            assert list(emb.results[0].embedding) == [float(len(tok.encode("a b c"))), 0.5]
            assert emb.results[1].prompt_tokens == len(tok.encode("d"))
            assert [e.rid for e in r.schedulers[0].seen.embed][-1].endswith("_1")
            e = await r.error(r.generate(prompts=[text_prompt("Hi")]))
            assert e.code() == CODE.INVALID_ARGUMENT and "embedding model; use Embed" in e.details()
        async with ring(tok) as r:  # a generation model embeds too (last-token pooling)
            await ring_ready(r)
            health = health_pb2_grpc.HealthStub(r.channel)

            async def serving() -> bool:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            for _ in range(50):  # readiness follows the peers within a poll period
                if await serving():
                    break
                await asyncio.sleep(0.1)
            assert await serving()
            await wait_for(lambda: r.manager.model_info is not None)
            emb = await r.stub.Embed(tokenizer_pb2.EmbedRequest(prompts=[text_prompt("a")]))
            assert len(emb.results) == 1 and r.schedulers[0].seen.embed

    asyncio.run(run())


def test_scheduler_refusal_503_is_retried_on_another_scheduler(tok):
    async def run():
        async with ring(tok, schedulers=2) as r:
            await ring_ready(r)
            a, b = r.schedulers
            a.direct_error = (503, "scheduler fake-0 is shutting down; retry on another scheduler")
            for i in range(2):  # round robin hits fake-0 once
                out = await r.generate(
                    prompts=[text_prompt("Hi")],
                    rid=f"x{i}",
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=2),
                )
                assert out[-1].meta_info.id == f"x{i}" and out[-1].text == tok.decode(r.tokens[:2])
            on_b = {g.rid for g in b.seen.generate}
            assert "x0_retry" in on_b or "x1_retry" in on_b  # what fake-0 refused ran on fake-1
            assert {g.rid for g in a.seen.generate} <= {"x0", "x1"}
            a.direct_error = b.direct_error = (503, "overloaded")
            e = await r.error(r.generate(prompts=[text_prompt("Hi")]))
            assert e.code() == CODE.RESOURCE_EXHAUSTED and "overloaded" in e.details()

    asyncio.run(run())


def test_admission_limit_and_drain(tok):
    async def run():
        async with ring(tok, max_queued_requests=2) as r:
            await ring_ready(r)
            fake = r.schedulers[0]
            e = await r.error(r.generate(prompts=[text_prompt("Hi")], sampling_params=common_pb2.SamplingParams(n=3)))
            assert e.code() == CODE.INVALID_ARGUMENT and "max_queued_requests=2" in e.details()
            fake.hold = True
            calls = [
                r.stub.Generate(tokenizer_pb2.GenerateRequest(prompts=[text_prompt("Hi")], rid=f"h{i}"))
                for i in range(2)
            ]
            await wait_for(lambda: len(r.manager.states) == 2)
            e = await r.error(r.generate(prompts=[text_prompt("Hi")]))
            assert e.code() == CODE.RESOURCE_EXHAUSTED and "max_queued_requests=2" in e.details()

            drain = asyncio.create_task(r.manager.drain(0.3))
            await wait_for(lambda: r.manager.draining)
            e = await r.error(r.generate(prompts=[text_prompt("Hi")]))
            assert e.code() == CODE.UNAVAILABLE and "draining" in e.details()
            for c in calls:
                e = await r.error(_gen_list(c))
                assert e.code() == CODE.UNAVAILABLE and "shutting down" in e.details()
            await drain
            await wait_for(lambda: {a.rid for a in fake.seen.aborts} >= {"h0", "h1"})

    asyncio.run(run())


def test_spans_continue_the_caller_trace_and_travel_with_the_request(tok):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        pytest.skip("another tracer provider is installed in this process")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"

    async def run():
        async with ring(tok) as r:
            await ring_ready(r)
            await r.generate(
                prompts=[text_prompt("Hi")],
                rid="traced",
                trace=common_pb2.TraceContext(traceparent=f"00-{trace_id}-{parent}-01"),
                sampling_params=common_pb2.SamplingParams(max_new_tokens=2),
            )
            await r.generate(
                prompts=[text_prompt("Hi")],
                rid="root",
                sampling_params=common_pb2.SamplingParams(max_new_tokens=1),
            )
            return {g.rid: g.trace.traceparent for g in r.schedulers[0].seen.generate}

    sent = asyncio.run(run())
    spans = exporter.get_finished_spans()
    gen = next(s for s in spans if s.name == "generate" and s.attributes.get("meshlm.rid") == "traced")
    assert format(gen.context.trace_id, "032x") == trace_id and format(gen.parent.span_id, "016x") == parent
    tokenize = [
        s for s in spans if s.name == "tokenize" and s.parent is not None and s.parent.span_id == gen.context.span_id
    ]
    assert len(tokenize) == 1
    # the scheduler gets the generate span as the parent of its own spans
    assert sent["traced"] == f"00-{trace_id}-{format(gen.context.span_id, '016x')}-01"
    root = next(s for s in spans if s.name == "generate" and s.attributes.get("meshlm.rid") == "root")
    assert root.parent is None and sent["root"].split("-")[1] == format(root.context.trace_id, "032x")


def test_process_serves_and_exits_0_on_sigterm(tok):
    import os
    import signal
    import subprocess
    import time

    port = free_port()
    env = dict(os.environ, MESHLM_TOKENIZER_SCHEDULER_ADDRS=f"127.0.0.1:{free_port()}")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshlm.tokenizer",
            "--tokenizer-path",
            str(tok.path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--detokenizer-addrs",
            f"127.0.0.1:{free_port()}",
            "--grace-period-s",
            "2",
            "--log-format",
            "json",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        async def probe() -> list[int]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await asyncio.wait_for(ch.channel_ready(), 60)
                out = await tokenizer_pb2_grpc.TokenizerServiceStub(ch).Tokenize(
                    tokenizer_pb2.TokenizeRequest(prompt=text_prompt("Hello world")), timeout=10
                )
                return list(out.tokens)

        assert asyncio.run(probe()) == tok.encode("Hello world")
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10
        err = proc.stderr.read()
        assert '"service": "tokenizer"' in err and "draining" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the full ring: real scheduler service (SmolLM2) + real detokenizer ----------------------


@pytest.mark.slow
def test_full_ring_with_real_scheduler_matches_hf_greedy(tok, smollm_path, smollm_tokenizer):
    pytest.importorskip("torch")
    from meshlm.detokenizer.config import DetokenizerConfig
    from meshlm.detokenizer.service import start_detokenizer
    from meshlm.scheduler.config import SchedulerConfig
    from meshlm.scheduler.service.config import SchedulerServiceConfig
    from meshlm.scheduler.service.server import SchedulerServer

    messages = [("user", "What is the capital of France?")]

    async def run() -> tuple[list, list, list]:
        detok = await start_detokenizer(DetokenizerConfig(tokenizer_path=smollm_path, host="127.0.0.1", port=0))
        daddr = f"127.0.0.1:{detok.port}"
        sched = SchedulerServer(
            SchedulerServiceConfig(host="127.0.0.1", port=0, detokenizer_addrs=(daddr,), grace_period_s=2.0),
            SchedulerConfig(
                model_path=smollm_path,
                device="cpu",
                dtype="float32",
                load_progress=False,
                max_total_tokens=4096,
            ),
        )
        await sched.start()
        cfg = TokenizerConfig(
            host="127.0.0.1",
            port=0,
            tokenizer_path=None,
            scheduler_addrs=(f"127.0.0.1:{sched.port}",),
            detokenizer_addrs=(daddr,),
            connect_timeout_s=10.0,
        )
        running = await start_server(cfg)  # learns the tokenizer path from the scheduler
        server, manager = running.server, running.manager
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        try:
            sp = common_pb2.SamplingParams(max_new_tokens=8, temperature=0.0)
            req = dict(prompts=[chat_prompt(*messages)], sampling_params=sp)
            streamed = [x async for x in stub.Generate(tokenizer_pb2.GenerateRequest(stream=True, **req), timeout=120)]
            whole = [x async for x in stub.Generate(tokenizer_pb2.GenerateRequest(stream=False, **req), timeout=120)]
            # cancel mid-way: the scheduler frees the request
            slow = stub.Generate(
                tokenizer_pb2.GenerateRequest(
                    prompts=[chat_prompt(*messages)],
                    stream=True,
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=2000, ignore_eos=True),
                ),
                timeout=120,
            )
            await slow.read()
            slow.cancel()
            await wait_for(lambda: manager.states == {} and sched.tracker.num_live() == 0, timeout=20)
            info = await stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest())
            return streamed, whole, list(info.schedulers)
        finally:
            await channel.close()
            await running.close()
            await sched.close()
            await detok.stop(0.5)

    streamed, whole, loads = asyncio.run(run())
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_path, torch_dtype=torch.float32)
    ids = tok.chat_ids([{"role": r, "content": c} for r, c in messages])[1]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0][len(ids) :].tolist()
    assert [i for x in streamed for i in x.output_ids] == ref
    assert "".join(x.text for x in streamed) == whole[0].text == smollm_tokenizer.decode(ref, skip_special_tokens=True)
    assert whole[0].meta_info.completion_tokens == len(ref) and whole[0].finished
    assert loads and loads[0].scheduler_id
