"""Direct SSE delivery (sse_direct.DirectSend with openai_streams.choice_events over a real
MuxStream): a running choice's events are sent from the code that feeds the stream, without the
response's task; the body is byte for byte what the task-driven path sends, in order, whatever
the client does: it reads at once, its socket fills (a send waits: later events are held and
sent after it, under the stall bound), it stops reading (a stall), or the handling of one
response raises (that stream ends with an error event; the feeder is untouched). One test runs
real uvicorn over a socket with a small send buffer, where uvicorn's own send waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest

from meshlm.common import event_loop
from meshlm.gateway.app import GatewayMetrics
from meshlm.gateway.config import GatewayConfig
from meshlm.gateway.generate_mux import MuxStream
from meshlm.gateway.openai_outputs import CompletionChunks
from meshlm.gateway.openai_streams import choice_events
from meshlm.gateway.outputs import Output, sse_response
from meshlm.gateway.sse_direct import SERVER_SEND, DirectSend
from meshlm.v1 import common_pb2, tokenizer_pb2


class FakeCall:
    """What a MuxStream needs of its GenerateStream call."""

    address = "tok:1"

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def send_cancel(self, stream_id: int) -> None:
        self.cancelled.append(stream_id)

    def forget(self, stream_id: int) -> None:
        pass


def response(k: int, count: int, index: int = 0) -> tokenizer_pb2.GenerateResponse:
    finished = k == count - 1
    finish = common_pb2.FinishReason(type=common_pb2.FINISH_TYPE_LENGTH, length=count) if finished else None
    meta = tokenizer_pb2.MetaInfo(id="r", finish_reason=finish, prompt_tokens=2, completion_tokens=k + 1)
    return tokenizer_pb2.GenerateResponse(index=index, text=f" w{k}", output_ids=[k], meta_info=meta, finished=finished)


def item(r: tokenizer_pb2.GenerateResponse) -> tokenizer_pb2.GenerateStreamItem:
    return tokenizer_pb2.GenerateStreamItem(stream_id=1, response=r)


def end_item() -> tokenizer_pb2.GenerateStreamItem:
    return tokenizer_pb2.GenerateStreamItem(stream_id=1, end=tokenizer_pb2.StreamEnd(code=0))


def scope_of(stall_s: float, metrics: GatewayMetrics) -> dict[str, Any]:
    config = GatewayConfig(tokenizer_addrs=("127.0.0.1:1",), stream_stall_timeout_s=stall_s)
    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(config=config), metrics=metrics))
    return {"type": "http", "asgi": {"spec_version": "2.3"}, "app": app, "client": ("10.0.0.1", 5)}


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def on_response_of(chunks: CompletionChunks, fail_at: int | None = None):
    def on_response(out: Output, r: tokenizer_pb2.GenerateResponse, first: bool) -> Iterable[str]:
        if fail_at is not None and len(out.output_ids) == fail_at:
            raise ValueError("formatting failed")
        # two events a response: a held event must keep its place between them
        yield chunks.event(r.index, r.text, None, None)
        yield chunks.event(r.index, "", out.openai_finish_reason(), out.matched_stop())

    return on_response


def on_done(outputs: dict[int, Output]) -> Iterable[str]:
    yield f"data: done {sum(o.completion_tokens for o in outputs.values())}\n\n"


class Client:
    """An ASGI send that records body bytes; `block()` makes sends wait until `unblock()`."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.sends = 0
        self._open = asyncio.Event()
        self._open.set()
        self.waiting = 0

    def block(self) -> None:
        self._open.clear()

    def unblock(self) -> None:
        self._open.set()

    async def __call__(self, message: dict[str, Any]) -> None:
        self.sends += 1
        if message["type"] == "http.response.body" and not self._open.is_set():
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1
        if message["type"] == "http.response.body":
            self.body.append(message.get("body", b""))

    def text(self) -> str:
        return b"".join(self.body).decode()


async def serve(
    count: int,
    use_direct: bool,
    client: Client,
    *,
    stall_s: float = 5.0,
    during=None,
    fail_at: int | None = None,
    server: Client | None = None,
) -> tuple[MuxStream, list[bool], GatewayMetrics, list[str]]:
    """Stream `count` responses through choice_events + SSEResponse; the feeder yields to the
    loop between responses and `during(k, client)` runs before response k is fed. With `server`,
    the scope carries it as the server's own send (SERVER_SEND) and `client` is a middleware's
    send wrapper in front of it. Returns the stream, on_close's record, the metrics and the
    response task's wake-ups' log."""
    metrics = GatewayMetrics()
    closed: list[bool] = []
    stream = MuxStream(FakeCall(), 1, time.monotonic() + 60)  # type: ignore[arg-type]
    stream.feed(item(response(0, count)))
    await stream.take_first()
    direct = DirectSend() if use_direct else None
    chunks = CompletionChunks("r", 1, "m")
    body = choice_events(stream, on_response_of(chunks, fail_at), on_done, direct)
    wakes: list[str] = []
    original = stream.next_response

    async def next_response():
        r = await original()
        wakes.append("end" if r is None else f"w{len(wakes)}")
        return r

    stream.next_response = next_response  # type: ignore[method-assign]
    scope = scope_of(stall_s, metrics)
    if server is not None:
        scope[SERVER_SEND] = server
    task = asyncio.ensure_future(
        sse_response(body, lambda: closed.append(True), direct)(scope, never_disconnects, client)
    )
    for k in range(1, count):
        await asyncio.sleep(0.001)
        if during is not None:
            await during(k, client)
        stream.feed(item(response(k, count)))
    stream.feed(end_item())
    await asyncio.wait_for(task, 10)
    return stream, closed, metrics, wakes


def expected_body(count: int) -> str:
    chunks = CompletionChunks("r", 1, "m")
    events = []
    for k in range(count):
        reason = "length" if k == count - 1 else None
        events += [chunks.event(0, f" w{k}", None, None), chunks.event(0, "", reason, None)]
    return "".join(events) + f"data: done {count}\n\n" + "data: [DONE]\n\n"


def test_direct_delivery_sends_what_the_task_path_sends_without_waking_the_task() -> None:
    async def run() -> None:
        task_client, direct_client = Client(), Client()
        _, closed_t, _, wakes_t = await serve(20, False, task_client)
        _, closed_d, _, wakes_d = await serve(20, True, direct_client)
        assert task_client.text() == direct_client.text() == expected_body(20)
        assert closed_t == closed_d == [True]
        # the task path wakes for each of the 19 later responses and the end; the direct one
        # only for the last response (a finish reason) and the end
        assert len(wakes_t) == 20 and wakes_d == ["w0", "end"]

    asyncio.run(run())


class Wrapper(Client):
    """A middleware's send wrapper: records what passes through it and hands it to the server."""

    def __init__(self, server: Client) -> None:
        super().__init__()
        self.server = server
        self.types: list[str] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.types.append(message["type"])
        await super().__call__(message)
        await self.server(message)


def test_direct_events_go_to_the_servers_send_past_the_middlewares() -> None:
    async def during(k: int, client: Client) -> None:
        if k == 5:
            client.server.block()  # type: ignore[attr-defined]
        if k == 9:
            client.server.unblock()  # type: ignore[attr-defined]

    async def run() -> None:
        server = Client()
        wrapper = Wrapper(server)
        _, closed, _, wakes = await serve(20, True, wrapper, server=server, during=during)
        assert server.text() == expected_body(20)  # every event, in order, with a send that waited
        assert closed == [True]
        # the start message and what the response's task sent (the first events, the events held
        # behind the waiting send, the end) went through the wrapper; the direct events did not
        assert wrapper.types[0] == "http.response.start"
        passed = wrapper.text()
        assert 0 < len(passed) < len(server.text()) and server.text().endswith(passed[-40:])
        assert 2 < len(wakes) < 10, wakes

    asyncio.run(run())


def test_a_send_that_waits_holds_later_events_and_sends_them_after_it_in_order() -> None:
    async def during(k: int, client: Client) -> None:
        if k == 5:
            client.block()  # the socket is full from response 5 on
        if k == 9:
            client.unblock()

    async def run() -> None:
        client = Client()
        stream, closed, metrics, wakes = await serve(20, True, client, during=during)
        assert client.text() == expected_body(20)
        assert closed == [True]
        assert stream._items[-1] is None  # ended OK, nothing left queued
        # the task woke for the first response queued behind the waiting send, took over, and
        # went back to direct delivery once the client read again
        assert 2 < len(wakes) < 10, wakes

    asyncio.run(run())


def test_a_client_that_stops_reading_during_direct_delivery_is_a_stall() -> None:
    async def during(k: int, client: Client) -> None:
        if k == 3:
            client.block()  # never unblocked

    async def run() -> None:
        client = Client()
        metrics = GatewayMetrics()
        stream = None
        try:
            stream, closed, metrics, _ = await serve(400, True, client, stall_s=0.2, during=during)
        except asyncio.TimeoutError:
            raise AssertionError("the stalled stream did not end") from None
        assert closed == [True]
        assert metrics.metrics.registry.get_sample_value("meshlm:stalled_streams_total") == 1
        assert stream._call.cancelled == [1]  # the request is aborted at the tokenizer
        assert client.waiting == 0  # the waiting send was cancelled with the stream

    asyncio.run(run())


def test_a_response_whose_handling_raises_ends_its_stream_with_an_error_event() -> None:
    async def run() -> None:
        client = Client()
        stream, closed, _, _ = await serve(10, True, client, fail_at=4)
        text = client.text()
        expected = expected_body(10)
        assert text.startswith(expected[: expected.rindex("data: ", 0, expected.index(" w3"))])  # w0..w2
        assert '"code":500' in text and "formatting failed" in text
        assert text.endswith("data: [DONE]\n\n") and " w3" not in text
        assert stream._call.cancelled == [1] and closed == [True]

    asyncio.run(run())


@pytest.mark.parametrize("waits", [False, True])
def test_direct_send_order_and_close(waits: bool) -> None:
    async def run() -> None:
        client = Client()
        direct = DirectSend()
        direct.bind(client, None)
        assert direct.ready
        if waits:
            client.block()
        for i in range(3):
            direct.write(f"e{i}")
        if not waits:
            assert client.text() == "e0e1e2" and direct.ready
            return
        assert direct.blocked and not direct.ready and client.waiting == 1
        resumed = asyncio.ensure_future(direct.resume())
        await asyncio.sleep(0.01)
        assert not resumed.done()  # still waiting for e0's send
        client.unblock()
        assert await resumed == ["e1", "e2"] and client.text() == "e0" and direct.ready
        client.block()
        direct.write("e3")
        direct.close()
        await asyncio.sleep(0.01)
        assert client.waiting == 0 and client.text() == "e0"  # the waiting send was cancelled
        direct.write("e4")  # after close: nothing
        assert client.sends == 2

    asyncio.run(run())


def test_a_mux_stream_delivers_directly_only_what_has_nothing_queued_before_it() -> None:
    async def run() -> None:
        stream = MuxStream(FakeCall(), 1, time.monotonic() + 60)  # type: ignore[arg-type]
        taken: list[str] = []
        accepting = [False]

        def deliver(r: tokenizer_pb2.GenerateResponse) -> bool:
            if accepting[0]:
                taken.append(r.text)
            return accepting[0]

        assert stream.set_direct(deliver)
        stream.feed(item(response(0, 5)))  # declined: queued
        accepting[0] = True
        stream.feed(item(response(1, 5)))  # accepted, but 0 is queued before it: queued too
        assert taken == []
        assert [(await stream.next_response()).text for _ in range(2)] == [" w0", " w1"]
        stream.feed(item(response(2, 5)))  # nothing queued: delivered
        assert taken == [" w2"]
        stream.feed(end_item())  # an end is always queued, and ends direct delivery
        assert await stream.next_response() is None
        stream.feed(item(response(3, 5)))
        assert taken == [" w2"]

    asyncio.run(run())


def test_over_a_real_uvicorn_socket_that_fills_the_stream_arrives_whole_and_in_order(monkeypatch) -> None:
    """uvicorn (httptools, on uvloop) on a socket whose send buffer is fixed small, a client that reads
    nothing for a while: uvicorn's send waits on its flow control mid-stream (the trampoline
    finishes it), later events are held and sent after it, and the body is exact."""
    import socket

    import uvicorn

    from meshlm.gateway import sse_direct

    finished: list[int] = []
    real_finish = sse_direct._finish

    async def counting_finish(coro, waiting):
        await real_finish(coro, waiting)
        finished.append(1)

    monkeypatch.setattr(sse_direct, "_finish", counting_finish)
    count, pad = 120, "x" * 2000  # ~240 KB: past a 4 KiB socket buffer and uvicorn's 64 KiB

    def big(k: int) -> tokenizer_pb2.GenerateResponse:
        r = response(k, count)
        r.text = f" w{k}{pad}"
        return r

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        stream = MuxStream(FakeCall(), 1, time.monotonic() + 60)  # type: ignore[arg-type]
        stream.feed(item(big(0)))
        await stream.take_first()
        direct = DirectSend()
        body = choice_events(stream, on_response_of(CompletionChunks("r", 1, "m")), on_done, direct)

        async def feed() -> None:
            for k in range(1, count):
                await asyncio.sleep(0.001)
                stream.feed(item(big(k)))
            stream.feed(end_item())

        feeder = asyncio.ensure_future(feed())
        await sse_response(body, stream.cancel, direct)(scope, receive, send)
        await feeder

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def client() -> bytes:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.5)  # the server's buffers fill meanwhile
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # then read at speed
            sock.settimeout(30)
            parts: list[bytes] = []
            while chunk := sock.recv(1 << 16):
                parts.append(chunk)
                if b"data: [DONE]" in b"".join(parts[-2:]):
                    break
            return b"".join(parts)

    async def run() -> bytes:
        config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning")
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[listener]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(asyncio.to_thread(client), 60)
        finally:
            server.should_exit = True
            await serving

    data = event_loop.run(run())  # the loop the gateway runs (uvloop where installed)
    assert data.startswith(b"HTTP/1.1 200")
    events = [line + "\n\n" for line in data.decode().split("\r\n") if line.startswith("data: ")]
    chunks = CompletionChunks("r", 1, "m")
    expected = []
    for k in range(count):
        reason = "length" if k == count - 1 else None
        expected += [chunks.event(0, f" w{k}{pad}", None, None), chunks.event(0, "", reason, None)]
    expected += [f"data: done {count}\n\n", "data: [DONE]\n\n"]
    assert [e.strip() for e in events] == [e.strip() for e in expected]
    assert finished, "no send ever waited: the test did not fill the socket"
