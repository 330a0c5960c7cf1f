"""Gateway test helpers: a fake TokenizerService (grpc.aio, in a thread) that answers deterministically:

the output of a prompt is max_new_tokens words " w0", " w1", ... (ids 100, 101, ...), finishing
with "length"; a prompt containing "STOP" finishes after one word with matched_str "STOP";
a prompt containing "HANG" sends one word (streaming; nothing when not streaming, as a real
tokenizer answers a non-stream request at the end) and then waits until the call is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import grpc

from meshlm.common.grpc_server import GrpcServer
from meshlm.gateway.config import GatewayConfig
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: connections are refused at once
MODEL = "test-model"


def prompt_words(prompt: tokenizer_pb2.Prompt) -> list[str]:
    kind = prompt.WhichOneof("kind")
    if kind == "text":
        return prompt.text.split()
    if kind == "input_ids":
        return [str(i) for i in prompt.input_ids.ids]
    return " ".join(m.content for m in prompt.messages.messages).split()


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.cancelled: list[str] = []
        self.aborts: list[tokenizer_pb2.AbortRequest] = []
        self.error: tuple[grpc.StatusCode, str] | None = None  # Generate fails with this
        self.abort_finish: tuple[int, str] | None = None  # Generate ends with FINISH_TYPE_ABORT
        self.flush_ok = True

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.error:
            await context.abort(*self.error)
        sp = request.sampling_params
        n = sp.n if sp.HasField("n") else 1
        max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else 128
        for p_index, prompt in enumerate(request.prompts):
            words = prompt_words(prompt)
            for j in range(n):
                index = p_index * n + j
                rid = request.rid if len(request.prompts) * n == 1 else f"{request.rid}_{index}"
                if self.abort_finish:
                    status, message = self.abort_finish
                    finish = common_pb2.FinishReason(
                        type=common_pb2.FINISH_TYPE_ABORT, status_code=status, message=message
                    )
                    yield tokenizer_pb2.GenerateResponse(
                        index=index,
                        finished=True,
                        meta_info=tokenizer_pb2.MetaInfo(id=rid, finish_reason=finish, prompt_tokens=len(words)),
                    )
                    return
                stop = "STOP" in words
                count = 1 if stop or "HANG" in words else max_new
                responses = [self._step(request, rid, index, words, k, count, stop) for k in range(count)]
                if not request.stream:
                    responses = [self._merge(responses)]
                for response in responses if request.stream or "HANG" not in words else []:
                    yield response
                if "HANG" in words:
                    try:
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:
                        self.cancelled.append(request.rid)
                        raise

    def _step(self, request, rid, index, words, k, count, stop):
        lp = common_pb2.LogprobDelta()
        if request.return_logprob:
            text = request.return_text_in_logprobs
            if k == 0 and request.HasField("logprob_start_len"):
                for i, w in enumerate(words):
                    lp.input_token_logprobs.append(
                        common_pb2.TokenLogprob(
                            logprob=-1.0, token_id=i, text=(" " + w if i else w) if text else "", has_logprob=i > 0
                        )
                    )
                    lp.input_top_logprobs.append(common_pb2.TopLogprobs())
            lp.output_token_logprobs.append(
                common_pb2.TokenLogprob(logprob=-0.5, token_id=100 + k, text=f" w{k}" if text else "", has_logprob=True)
            )
            lp.output_top_logprobs.append(
                common_pb2.TopLogprobs(
                    entries=[
                        common_pb2.TokenLogprob(
                            logprob=-0.5 - t, token_id=100 + k + t, text=f" w{k + t}" if text else "", has_logprob=True
                        )
                        for t in range(request.top_logprobs_num)
                    ]
                )
            )
        finished = k == count - 1
        finish = None
        if finished:
            finish = (
                common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_STOP, matched_str="STOP")
                if stop
                else common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH, length=count)
            )
        meta = tokenizer_pb2.MetaInfo(
            id=rid,
            finish_reason=finish,
            prompt_tokens=len(words),
            completion_tokens=k + 1,
            cached_tokens=1,
            logprobs=lp,
        )
        return tokenizer_pb2.GenerateResponse(
            index=index, text=f" w{k}", output_ids=[100 + k], meta_info=meta, finished=finished
        )

    @staticmethod
    def _merge(responses):
        whole = tokenizer_pb2.GenerateResponse()
        for r in responses:
            lp = whole.meta_info.logprobs
            lp.MergeFrom(r.meta_info.logprobs)
            text, ids = whole.text + r.text, list(whole.output_ids) + list(r.output_ids)
            meta = tokenizer_pb2.MetaInfo()
            meta.CopyFrom(r.meta_info)
            meta.logprobs.CopyFrom(lp)
            whole = tokenizer_pb2.GenerateResponse(
                index=r.index, text=text, output_ids=ids, meta_info=meta, finished=r.finished
            )
        return whole

    async def Embed(self, request, context):
        results = [
            tokenizer_pb2.EmbeddingResult(index=i, embedding=[0.5, -0.25, float(i)], prompt_tokens=len(prompt_words(p)))
            for i, p in enumerate(request.prompts)
        ]
        return tokenizer_pb2.EmbedResponse(results=results)

    async def Abort(self, request, context):
        self.aborts.append(request)
        return tokenizer_pb2.AbortResponse()

    async def Tokenize(self, request, context):
        ids = list(range(len(prompt_words(request.prompt))))
        return tokenizer_pb2.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=2048)

    async def Detokenize(self, request, context):
        return tokenizer_pb2.DetokenizeResponse(text=" ".join(f"t{i}" for i in request.tokens))

    async def GetModelInfo(self, request, context):
        return common_pb2.ModelInfo(
            model_path="/models/test",
            served_model_name=MODEL,
            is_generation=True,
            context_length=2048,
            vocab_size=1000,
            eos_token_ids=[2],
        )

    async def GetServerInfo(self, request, context):
        load = common_pb2.SchedulerLoad(
            scheduler_id="s0", num_running_reqs=1, num_queue_reqs=2, num_used_tokens=30, max_total_num_tokens=4096
        )
        return tokenizer_pb2.ServerInfo(
            model=await self.GetModelInfo(None, None),
            schedulers=[load],
            version="0.1.0",
            tokenizer_id="tok-0",
            config_json='{"routing": "round_robin"}',
        )

    async def GetLoads(self, request, context):
        """Scheduler 0 reported 1 running + 2 waiting 0.25 s ago; scheduler 1 has not reported."""
        self.requests.append(request)
        reports = [
            tokenizer_pb2.SchedulerLoadReport(
                dp_rank=0,
                address="h:1",
                connected=True,
                report_age_s=0.25,
                load=common_pb2.SchedulerLoad(
                    scheduler_id="s0",
                    num_running_reqs=1,
                    num_queue_reqs=2,
                    num_used_tokens=30,
                    max_total_num_tokens=4096,
                    token_usage=30 / 4096,
                    max_running_requests=8,
                ),
            ),
            tokenizer_pb2.SchedulerLoadReport(dp_rank=1, address="h:2"),
        ]
        if request.HasField("dp_rank"):
            if request.dp_rank > 1:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "dp_rank must be in [0, 1]")
            reports = [r for r in reports if r.dp_rank == request.dp_rank]
        return tokenizer_pb2.GetLoadsResponse(schedulers=reports, version="0.1.0", tokenizer_id="tok-0")

    async def FlushCache(self, request, context):
        return tokenizer_pb2.FlushCacheResponse(
            success=self.flush_ok, message="" if self.flush_ok else "requests are running"
        )

    async def OpenSession(self, request, context):
        return tokenizer_pb2.OpenSessionResponse(session_id=request.session_id or "generated")

    async def CloseSession(self, request, context):
        if request.session_id != "s1":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
        return tokenizer_pb2.CloseSessionResponse()


class FakeTokenizerServer:
    """A FakeTokenizer served by meshlm's GrpcServer (health + reflection) on its own loop thread."""

    def __init__(self) -> None:
        self.servicer = FakeTokenizer()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeTokenizerServer:
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.address = f"127.0.0.1:{self.port}"
        return self

    async def _start(self) -> int:
        self.server = GrpcServer(["meshlm.v1.TokenizerService"], host="127.0.0.1", port=0)
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(self.servicer, self.server.server)
        return await self.server.start()

    def set_serving(self, serving: bool) -> None:
        asyncio.run_coroutine_threadsafe(self.server.set_serving(serving), self.loop).result(10)

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self.server.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_config(**overrides: Any) -> GatewayConfig:
    values: dict[str, Any] = {"tokenizer_addrs": (UNREACHABLE,), "served_model_name": MODEL}
    values.update(overrides)
    return GatewayConfig(**values)


def sse_events(response) -> list:
    """The data events of an SSE response (which must end with [DONE]), JSON decoded."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    return events[:-1]


def last_request(fake):
    """What the fake tokenizer received last."""
    return fake.servicer.requests[-1]
