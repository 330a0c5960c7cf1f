"""Contract tests of meshlm.v1.TokenizerService when the ring misbehaves or is managed: a lost or
refusing scheduler, routing by load, flush / sessions / model info, Embed, admission and
drain, trace spans, the process and SIGTERM, and the full ring with the REAL scheduler (SmolLM2).

Peers as in test_tokenizer_contract.py: the REAL detokenizer and scripted schedulers
(tokenizer_fakes.FakeScheduler)."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.service import start_server
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.spans import capture_spans

from .tokenizer_ring import CODE, chat_prompt, free_port, gen_list, ring, ring_ready, text_prompt, wait_for


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


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
            out = await gen_list(call)
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
            e = await r.error(gen_list(call))
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

            loads = await r.stub.GetLoads(tokenizer_pb2.GetLoadsRequest())
            assert [(s.dp_rank, s.connected, s.load.scheduler_id, s.load.num_queue_reqs) for s in loads.schedulers] == [
                (0, True, "fake-0", 5),
                (1, True, "fake-1", 1),
            ]
            assert all(0 <= s.report_age_s < 60 for s in loads.schedulers) and loads.in_flight_requests == 0
            assert loads.max_queued_requests == 4096 and loads.tokenizer_id == r.manager.origin
            one = await r.stub.GetLoads(tokenizer_pb2.GetLoadsRequest(dp_rank=1))
            assert [s.load.scheduler_id for s in one.schedulers] == ["fake-1"]
            e = await r.error(r.stub.GetLoads(tokenizer_pb2.GetLoadsRequest(dp_rank=2)))
            assert e.code() == CODE.INVALID_ARGUMENT and "dp_rank must be in [0, 1]" in e.details()

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
                e = await r.error(gen_list(c))
                assert e.code() == CODE.UNAVAILABLE and "shutting down" in e.details()
            await drain
            await wait_for(lambda: {a.rid for a in fake.seen.aborts} >= {"h0", "h1"})

    asyncio.run(run())


def test_spans_continue_the_caller_trace_and_travel_with_the_request(tok):
    exporter = capture_spans()
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
