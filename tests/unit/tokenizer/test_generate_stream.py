"""GenerateStreamCall (meshlm.tokenizer.generate_stream), the tokenizer's side of GenerateStream,
over a scripted generator in place of TokenizerManager.generate: the responses that are ready
together leave in one message, each stream ends with exactly one StreamEnd carrying the status
its Generate call would have, a cancel or the call's end closes the stream's generator (which is
what aborts its requests), a caller that stops reading gets RESOURCE_EXHAUSTED with every stream
closed, and a draining tokenizer ends an idle call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from meshlm.common.errors import ServiceError
from meshlm.common.input_limits import InvalidArgument
from meshlm.tokenizer.generate_stream import GenerateStreamCall
from meshlm.v1 import tokenizer_pb2


class Script:
    """A stand-in for TokenizerManager: request rid "<kind>-<n>" yields n responses, response i
    once the test sets steps[i] when kind is "step", at once when "free"; "busy" and "bad" raise
    before any output. Kinds "sink..." hand responses to the stream's sink (kept in `sinks` by rid,
    for the test to call as the detokenizer callback would) and yields only its last, index n - 1,
    once steps[n - 1] is set. Records which generators were closed."""

    def __init__(self) -> None:
        self.draining = False
        self.steps = [asyncio.Event() for _ in range(16)]
        self.closed: list[str] = []
        self.text = "x"
        self.sinks: dict[str, Callable[[tokenizer_pb2.GenerateResponse], None]] = {}

    async def generate(
        self, request: tokenizer_pb2.GenerateRequest, sink: Callable[[tokenizer_pb2.GenerateResponse], None]
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        kind, n = request.rid.rsplit("-", 1)
        try:
            if kind.startswith("sink"):
                self.sinks[request.rid] = sink
                await self.steps[int(n) - 1].wait()
                yield tokenizer_pb2.GenerateResponse(index=int(n) - 1, text=self.text)
                return
            if kind == "busy":
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (max_queued_requests=1)")
            if kind == "bad":
                raise InvalidArgument("sampling_params.temperature must be >= 0")
            for i in range(int(n)):
                if kind == "step":
                    await self.steps[i].wait()
                yield tokenizer_pb2.GenerateResponse(index=i, text=self.text)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request.rid)


def gen(stream_id: int, rid: str) -> tokenizer_pb2.GenerateStreamRequest:
    return tokenizer_pb2.GenerateStreamRequest(stream_id=stream_id, generate=tokenizer_pb2.GenerateRequest(rid=rid))


def cancel(stream_id: int) -> tokenizer_pb2.GenerateStreamRequest:
    return tokenizer_pb2.GenerateStreamRequest(stream_id=stream_id, cancel=True)


class Caller:
    """The caller's side: a queue of requests (None half-closes) and the call's responses."""

    def __init__(self, script: Script, max_backlog_bytes: int = 1 << 20) -> None:
        self.requests: asyncio.Queue[tokenizer_pb2.GenerateStreamRequest | None] = asyncio.Queue()
        self.responses = GenerateStreamCall(script, max_backlog_bytes).run(self._requests())

    async def _requests(self) -> AsyncIterator[tokenizer_pb2.GenerateStreamRequest]:
        while (msg := await self.requests.get()) is not None:
            yield msg

    async def next(self) -> tokenizer_pb2.GenerateStreamResponse:
        return await asyncio.wait_for(self.responses.__anext__(), 5)

    async def half_close(self) -> list[tokenizer_pb2.GenerateStreamItem]:
        """Half-close the call and read it to its end: the items of every message left."""
        self.requests.put_nowait(None)
        return [item for msg in [m async for m in self.responses] for item in msg.items]


def ends(items: list[tokenizer_pb2.GenerateStreamItem]) -> dict[int, tuple[int, str]]:
    return {i.stream_id: (i.end.code, i.end.message) for i in items if i.HasField("end")}


def test_a_step_of_every_stream_leaves_as_one_message_and_each_ends_once() -> None:
    async def run() -> None:
        script = Script()
        caller = Caller(script)
        for sid in range(1, 6):
            caller.requests.put_nowait(gen(sid, f"step-{3}"))
        await asyncio.sleep(0.05)  # every stream waits for the first step
        messages = []
        for step in script.steps[:3]:
            step.set()
            messages.append(await caller.next())
        # each step: one message with one response of each of the five streams
        for msg in messages:
            assert sorted(i.stream_id for i in msg.items if i.HasField("response")) == [1, 2, 3, 4, 5]
        per_stream = {
            sid: [i.response.index for m in messages for i in m.items if i.stream_id == sid and i.HasField("response")]
            for sid in range(1, 6)
        }
        assert all(idx == [0, 1, 2] for idx in per_stream.values()), per_stream
        tail = await caller.half_close()  # the call ends once every stream has ended
        assert not any(i.HasField("response") for i in tail)
        every = [item for msg in messages for item in msg.items] + tail
        assert ends(every) == {sid: (0, "") for sid in range(1, 6)}
        assert sum(i.HasField("end") for i in every) == 5  # one end each

    asyncio.run(run())


def test_sink_responses_leave_in_order_before_the_last_and_in_one_message() -> None:
    """What a stream's sink takes (a step's deltas, put by the callback that read them, without
    waking the stream's task) leaves with the other streams' in one message, before the response
    the task yields last; then each stream ends once."""

    async def run() -> None:
        script = Script()
        caller = Caller(script)
        caller.requests.put_nowait(gen(1, "sink_a-3"))
        caller.requests.put_nowait(gen(2, "sink_b-3"))
        for i in range(2):  # two steps, each one callback delivering to both streams
            reading = asyncio.ensure_future(caller.next())
            await asyncio.sleep(0.05)
            for rid in ("sink_a-3", "sink_b-3"):
                script.sinks[rid](tokenizer_pb2.GenerateResponse(index=i, text=script.text))
            msg = await reading
            assert [(it.stream_id, it.response.index) for it in msg.items] == [(1, i), (2, i)]
        script.steps[2].set()
        tail = await caller.half_close()
        assert [(it.stream_id, it.response.index) for it in tail if it.HasField("response")] in (
            [(1, 2), (2, 2)],
            [(2, 2), (1, 2)],
        )
        assert ends(tail) == {1: (0, ""), 2: (0, "")}
        assert sum(it.HasField("end") for it in tail) == 2

    asyncio.run(run())


def test_a_sink_of_a_cancelled_or_ended_stream_puts_nothing() -> None:
    """After the caller cancels a stream (its task may not have run yet) or the stream ended, what
    reaches its sink is dropped: a cancelled stream gets nothing more, an ended one nothing after
    its end."""

    async def run() -> None:
        script = Script()
        caller = Caller(script)
        caller.requests.put_nowait(gen(1, "sink_a-2"))
        caller.requests.put_nowait(gen(2, "sink_b-2"))
        reading = asyncio.ensure_future(caller.next())  # the call runs while it is read
        await asyncio.sleep(0.05)
        caller.requests.put_nowait(cancel(1))
        await asyncio.sleep(0.05)
        script.sinks["sink_a-2"](tokenizer_pb2.GenerateResponse(index=0, text="late"))
        script.sinks["sink_b-2"](tokenizer_pb2.GenerateResponse(index=0, text=script.text))
        script.steps[1].set()
        await asyncio.sleep(0.05)  # stream 2 yields its last response and ends
        script.sinks["sink_b-2"](tokenizer_pb2.GenerateResponse(index=5, text="after the end"))
        items = list((await reading).items) + await caller.half_close()
        assert [(it.stream_id, it.response.index) for it in items if it.HasField("response")] == [(2, 0), (2, 1)]
        assert ends(items) == {2: (0, "")}
        assert "sink_a-2" in script.closed

    asyncio.run(run())


def test_errors_end_only_their_stream_with_their_status() -> None:
    async def run() -> None:
        script = Script()
        caller = Caller(script)
        caller.requests.put_nowait(gen(1, "busy-1"))
        caller.requests.put_nowait(gen(2, "bad-1"))
        caller.requests.put_nowait(gen(3, "free-2"))
        items = await caller.half_close()
        got = ends(items)
        assert got[1] == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "queue full (max_queued_requests=1)")
        assert got[2] == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "sampling_params.temperature must be >= 0")
        assert got[3] == (0, "")
        assert [i.response.index for i in items if i.stream_id == 3 and i.HasField("response")] == [0, 1]

    asyncio.run(run())


def test_a_running_id_reused_is_refused_and_the_first_stream_goes_on() -> None:
    async def run() -> None:
        script = Script()
        caller = Caller(script)
        caller.requests.put_nowait(gen(7, "step-1"))
        await asyncio.sleep(0.02)
        caller.requests.put_nowait(gen(7, "free-1"))
        msg = await caller.next()
        assert ends(list(msg.items)) == {7: (grpc.StatusCode.INVALID_ARGUMENT.value[0], "stream_id 7 is running")}
        script.steps[0].set()
        items = await caller.half_close()
        assert [i.response.index for i in items if i.HasField("response")] == [0]
        assert ends(items) == {7: (0, "")}
        assert script.closed == ["step-1"]  # the refused duplicate never started

    asyncio.run(run())


def test_cancel_closes_the_stream_and_ends_it_silently() -> None:
    async def run() -> None:
        script = Script()
        caller = Caller(script)
        caller.requests.put_nowait(gen(1, "step-5"))
        caller.requests.put_nowait(gen(2, "step-1"))
        script.steps[0].set()
        first = await caller.next()
        assert {i.stream_id for i in first.items} >= {1}
        caller.requests.put_nowait(cancel(1))
        await asyncio.sleep(0.05)
        assert "step-5" in script.closed  # its generator was closed (its requests aborted)
        for step in script.steps:
            step.set()
        rest = await caller.half_close()
        assert all(i.stream_id == 2 for i in rest if i.HasField("response"))
        assert 1 not in ends(rest)  # a cancelled stream gets no end

    asyncio.run(run())


def test_the_call_ending_closes_every_stream() -> None:
    async def run() -> None:
        script = Script()
        caller = Caller(script)
        for sid in (1, 2, 3):
            caller.requests.put_nowait(gen(sid, "step-9"))
        script.steps[0].set()
        assert len((await caller.next()).items) == 3  # the call runs, its streams wait for step 1
        await caller.responses.aclose()  # the caller went away: grpc closes the handler
        assert sorted(script.closed) == ["step-9"] * 3

    asyncio.run(run())


def test_a_caller_that_stops_reading_gets_resource_exhausted_and_every_stream_closes() -> None:
    async def run() -> None:
        script = Script()
        script.text = "y" * 1000
        caller = Caller(script, max_backlog_bytes=20_000)
        caller.requests.put_nowait(gen(1, "free-1000"))  # ~1 MB of output, produced at once
        caller.requests.put_nowait(gen(2, "step-5"))
        first = await caller.next()  # the caller reads once, then stops
        assert first.items
        await asyncio.sleep(0.1)
        assert sorted(script.closed) == ["free-1000", "step-5"]  # stopped at the bound, not at 1 MB
        with pytest.raises(ServiceError) as exc:
            while True:
                await caller.next()
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_stream_backlog_bytes=20000" in exc.value.message

    asyncio.run(run())


def test_a_draining_tokenizer_ends_an_idle_call() -> None:
    async def run() -> None:
        script = Script()
        caller = Caller(script)
        caller.requests.put_nowait(gen(1, "free-1"))
        items = list((await caller.next()).items)
        while 1 not in ends(items):
            items += (await caller.next()).items
        script.draining = True  # the caller keeps the call open; the tokenizer ends it
        assert [m async for m in caller.responses] == []

    asyncio.run(run())
