"""A scripted SchedulerService for the tokenizer's contract tests.

It speaks the real protocol (docs/ring.md): Connect (hello, loads, control replies with
call_id, RequestError), and pushes BatchTokenIDOut steps to a REAL detokenizer over Push, which
delivers text to the tokenizer's Subscribe stream. What it generates is scripted: each request
emits `tokens` one per step (up to max_new_tokens), then finishes with LENGTH; a migrated request
(`resumed`) continues after its resumed ids, re-sending them from offset 0 with its first step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from meshlm.common import protocol
from meshlm.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)


@dataclass
class Seen:
    generate: list = field(default_factory=list)  # TokenizedGenerateReqInput
    embed: list = field(default_factory=list)
    aborts: list = field(default_factory=list)  # AbortReq
    origins: list = field(default_factory=list)
    sessions: dict = field(default_factory=dict)
    flushes: int = 0


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        scheduler_id: str,
        detokenizer_addr: str,
        tokens: list[int],
        *,
        step_s: float = 0.01,
        vocab_size: int = 49152,
        tokenizer_path: str = "",
    ) -> None:
        self.scheduler_id = scheduler_id
        self.detokenizer_addr = detokenizer_addr
        self.tokens = tokens
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.tokenizer_path = tokenizer_path
        self.seen = Seen()
        self.load = common_pb2.SchedulerLoad(scheduler_id=scheduler_id)
        # Behaviour switches set by tests.
        self.hold = False  # accept requests, never emit
        self.reject: tuple[int, str] | None = None  # ABORT finish through the ring
        self.direct_error: tuple[int, str] | None = None  # RequestError on Connect
        self.resend_at_end = False  # detokenizer resync: re-send everything from offset 0
        self.flush_ok = True
        self.is_generation = True
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._push_q: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._aborted: set[str] = set()
        self._conn_outs: list[asyncio.Queue] = []
        self._push_task: asyncio.Task | None = None

    async def start(self, port: int = 0) -> int:
        self.server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self._push_task = asyncio.create_task(self._push_loop())
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._push_task is not None:
            self._push_task.cancel()
        if self.server is not None:
            await self.server.stop(grace)

    # ---- Push to the detokenizer ----------------------------------------------------------
    async def _push_loop(self) -> None:
        channel = grpc.aio.insecure_channel(self.detokenizer_addr)

        async def requests():
            yield detokenizer_pb2.DetokenizerInput(hello=protocol.hello(self.scheduler_id))
            while True:
                yield await self._push_q.get()

        try:
            await detokenizer_pb2_grpc.DetokenizerServiceStub(channel).Push(requests())
        finally:
            await channel.close()

    def _emit(
        self,
        req,
        ids: list[int],
        offset: int,
        finish: common_pb2.FinishReason | None,
        seed: bool,
        completion: int,
    ) -> None:
        out = scheduler_pb2.BatchTokenIDOut(scheduler_id=self.scheduler_id)
        d = out.deltas.add(
            rid=req.rid,
            origin=req.origin,
            output_ids=ids,
            token_offset=offset,
            prompt_tokens=len(req.input_ids),
            completion_tokens=completion,
            trace=req.trace,
        )
        if finish is not None:
            d.finish_reason.CopyFrom(finish)
        sp = req.sampling_params
        if seed:
            d.seed.CopyFrom(
                scheduler_pb2.DecodeSeed(
                    prompt_tail_ids=list(req.input_ids[-5:]),
                    skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
                    spaces_between_special_tokens=True,
                    want_logprob_text=req.return_logprob,
                )
            )
        if req.return_logprob:
            for k, t in enumerate(ids):
                d.logprobs.output_token_logprobs.append(
                    common_pb2.TokenLogprob(logprob=-0.5 - offset - k, token_id=t, has_logprob=True)
                )
        self._push_q.put_nowait(detokenizer_pb2.DetokenizerInput(tokens=out))

    def _reject_embedding(self, e) -> None:
        assert self.reject is not None
        status, message = self.reject
        out = scheduler_pb2.BatchTokenIDOut(scheduler_id=self.scheduler_id)
        d = out.deltas.add(rid=e.rid, origin=e.origin, prompt_tokens=len(e.input_ids), trace=e.trace)
        d.seed.prompt_tail_ids.extend(e.input_ids[-5:])
        d.finish_reason.CopyFrom(
            common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_ABORT, message=message, status_code=status)
        )
        self._push_q.put_nowait(detokenizer_pb2.DetokenizerInput(tokens=out))

    async def _run_request(self, req, conn_out: asyncio.Queue) -> None:
        if self.direct_error is not None:
            status, message = self.direct_error
            conn_out.put_nowait(
                scheduler_pb2.SchedulerOutput(
                    error=scheduler_pb2.RequestError(
                        rid=req.rid,
                        reason=common_pb2.FinishReason(
                            type=common_pb2.FINISH_TYPE_ABORT, message=message, status_code=status
                        ),
                    )
                )
            )
            return
        if self.reject is not None:
            status, message = self.reject
            self._emit(
                req,
                [],
                0,
                common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_ABORT, message=message, status_code=status),
                True,
                0,
            )
            return
        sp = req.sampling_params
        max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else len(self.tokens)
        out_ids = self.tokens[:max_new]
        if not out_ids:
            self._emit(
                req,
                [],
                0,
                common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH, length=0),
                True,
                0,
            )
            return
        resumed = len(req.resumed.output_ids) if req.HasField("resumed") else 0  # a migrated request
        for k, t in enumerate(out_ids):
            if k < resumed:
                continue
            await asyncio.sleep(self.step_s)
            while self.hold and req.rid not in self._aborted:
                await asyncio.sleep(0.01)
            if req.rid in self._aborted:
                self._emit(
                    req,
                    [],
                    k,
                    common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_ABORT, message="aborted", status_code=499),
                    False,
                    k,
                )
                return
            last = k == len(out_ids) - 1
            finish = common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH, length=len(out_ids)) if last else None
            if last and self.resend_at_end:
                # A fail-over resync: all ids from 0 with a seed, then the finish (ring.md).
                self._emit(req, out_ids[:k], 0, None, True, k)
            if resumed and k == resumed:  # as the real scheduler: the resumed ids again, from offset 0
                self._emit(req, out_ids[: k + 1], 0, finish, True, k + 1)
                continue
            self._emit(req, [t], k, finish, k == 0, k + 1)

    # ---- RPCs -----------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        return common_pb2.ModelInfo(
            model_path="fake-model",
            tokenizer_path=self.tokenizer_path,
            is_generation=self.is_generation,
            context_length=8192,
            vocab_size=self.vocab_size,
            eos_token_ids=[2],
            architecture="LlamaForCausalLM",
            max_req_input_len=8000,
        )

    async def Connect(self, request_iterator, context):
        first = await request_iterator.__anext__()
        assert first.WhichOneof("msg") == "hello", first
        assert first.hello.protocol_version == protocol.PROTOCOL_VERSION, first
        self.seen.origins.append(first.hello.peer_id)
        out: asyncio.Queue = asyncio.Queue()
        self._conn_outs.append(out)
        out.put_nowait(scheduler_pb2.SchedulerOutput(load=self.load))

        async def read():
            async for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                if kind == "generate":
                    self.seen.generate.append(msg.generate)
                    task = asyncio.create_task(self._run_request(msg.generate, out))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif kind == "embed":
                    self.seen.embed.append(msg.embed)
                    e = msg.embed
                    if self.reject is not None:  # as the real loop: a rejection is a TokenDelta
                        self._reject_embedding(e)
                        continue
                    result = scheduler_pb2.EmbeddingOut(
                        rid=e.rid,
                        origin=e.origin,
                        embedding=[float(len(e.input_ids)), 0.5],
                        prompt_tokens=len(e.input_ids),
                        finish_reason=common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH),
                        trace=e.trace,
                    )
                    self._push_q.put_nowait(
                        detokenizer_pb2.DetokenizerInput(
                            embeddings=scheduler_pb2.BatchEmbeddingOut(scheduler_id=self.scheduler_id, results=[result])
                        )
                    )
                elif kind == "abort":
                    self.seen.aborts.append(msg.abort)
                    self._aborted.add(msg.abort.rid)
                elif kind == "get_load":
                    out.put_nowait(scheduler_pb2.SchedulerOutput(call_id=msg.call_id, load=self.load))
                elif kind == "flush_cache":
                    self.seen.flushes += 1
                    out.put_nowait(
                        scheduler_pb2.SchedulerOutput(
                            call_id=msg.call_id,
                            flush_cache=scheduler_pb2.FlushCacheOutput(
                                success=self.flush_ok,
                                message="" if self.flush_ok else "requests are running",
                            ),
                        )
                    )
                elif kind == "open_session":
                    sid = msg.open_session.session_id
                    ok = sid not in self.seen.sessions
                    self.seen.sessions[sid] = msg.open_session.capacity_of_str_len
                    out.put_nowait(
                        scheduler_pb2.SchedulerOutput(
                            call_id=msg.call_id,
                            open_session=scheduler_pb2.OpenSessionOutput(
                                session_id=sid,
                                success=ok,
                                message="" if ok else "session id already exists",
                            ),
                        )
                    )
                elif kind == "close_session":
                    known = self.seen.sessions.pop(msg.close_session.session_id, None) is not None
                    out.put_nowait(scheduler_pb2.SchedulerOutput(call_id=msg.call_id, ack=known))
            out.put_nowait(None)

        async def loads():  # like the real scheduler: a load report at least every ~2 s
            while True:
                await asyncio.sleep(1.0)
                out.put_nowait(scheduler_pb2.SchedulerOutput(load=self.load))

        reader = asyncio.create_task(read())
        reporter = asyncio.create_task(loads())
        try:
            while True:
                item = await out.get()
                if item is None:
                    return
                yield item
        finally:
            reader.cancel()
            reporter.cancel()
            self._conn_outs.remove(out)

    def push_load(self) -> None:
        for out in self._conn_outs:
            out.put_nowait(scheduler_pb2.SchedulerOutput(load=self.load))
