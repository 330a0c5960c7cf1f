"""A client that opens a stream and does not read (issue 12 part 5) cannot stall other requests or
grow memory without bound. The slow client is a raw socket with a 4 KiB receive buffer asking
native /generate for 3,000 tokens with 20 top logprobs each (native streaming is cumulative, so
its SSE chunks grow: the kernel's and uvicorn's buffers fill after ~100 tokens). Meanwhile normal
clients of the same gateway get their exact outputs; the gateway (`--stream-stall-timeout-s 3`)
drops the stalled stream and aborts its request (counted in meshlm:stalled_streams_total), the
scheduler frees its KV long before 3,000 tokens could be decoded, and neither the gateway's nor
the tokenizers' RSS grows by more than a bound (buffering the whole stream would take GiBs).
The tokenizer's own bound (a public-API caller that does not read) is
tests/contract/test_tokenizer_backlog.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx

from meshlm.launch.launcher import Child, System

from .clients import STREAM_DEADLINE_S, metric, native_body, native_once, native_stream, rss_mib, wait_idle_at
from .conftest import url_of

RSS_BOUND_MIB = 64.0
STALLED = "meshlm:stalled_streams_total"


def open_slow_client(address: str, body: dict) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock  # and never read it


def read_to_eof(sock: socket.socket, timeout_s: float = 60.0) -> bytes:
    sock.settimeout(timeout_s)
    parts = []
    while chunk := sock.recv(1 << 16):
        parts.append(chunk)
    return b"".join(parts)


def test_a_client_that_does_not_read_cannot_stall_others_or_grow_memory(frontend: System, second: Child) -> None:
    url = url_of(second)
    tokenizers = frontend.by_component("tokenizer")
    stalled_before = metric(httpx.get(url + "/metrics").text, STALLED)

    async def expected_outputs() -> list:
        async with httpx.AsyncClient(timeout=STREAM_DEADLINE_S) as c:
            return await asyncio.gather(*(native_once(c, url, native_body(i, 32, False)) for i in range(8)))

    expected = asyncio.run(expected_outputs())
    assert all(e.ok for e in expected)
    rss_before = [rss_mib(second), *(rss_mib(t) for t in tokenizers)]

    slow = open_slow_client(
        second.address,
        native_body(
            7,
            3000,
            True,
            sampling={"ignore_eos": True},
            return_logprob=True,
            top_logprobs_num=20,
            return_text_in_logprobs=True,
        ),
    )
    try:

        async def normal_clients() -> list:
            async with httpx.AsyncClient(timeout=STREAM_DEADLINE_S) as c:
                return await asyncio.gather(*(native_stream(c, url, native_body(i, 32, True)) for i in range(8)))

        got = asyncio.run(normal_clients())
        assert [e.text for e in got] == [e.text for e in expected]

        deadline = time.monotonic() + STREAM_DEADLINE_S
        while metric(httpx.get(url + "/metrics").text, STALLED) <= stalled_before:
            assert time.monotonic() < deadline, "the gateway never dropped the stalled stream"
            time.sleep(0.5)
        wait_idle_at(url, 20.0)  # its request was aborted: 3,000 tokens take minutes here
        rss_after = [rss_mib(second), *(rss_mib(t) for t in tokenizers)]
        growth = [a - b for a, b in zip(rss_after, rss_before, strict=True)]
        assert max(growth) < RSS_BOUND_MIB, f"RSS growth MiB (gateway, tokenizers): {growth}"

        # The client reads at last: what the buffers held, then the connection closes, no [DONE].
        data = read_to_eof(slow)
        assert data.startswith(b"HTTP/1.1 200") and b"data: " in data and b"[DONE]" not in data
    finally:
        slow.close()

    assert asyncio.run(expected_outputs())[0].text == expected[0].text  # still serving
