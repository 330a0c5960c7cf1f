"""Generate calls of the OpenAI routes: run one to the end, or open it as an SSE stream whose
body is the choices' events (always cancelled, always ending with [DONE])."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from meshlm.common.errors import ServiceError
from meshlm.gateway.errors import APIError
from meshlm.gateway.grpc_client import ClientDisconnected, GenerateStream, cancel_on_disconnect
from meshlm.gateway.outputs import (
    SSE_DONE,
    Output,
    SSEResponse,
    abort_error,
    first_abort,
    sse_error,
    sse_response,
)
from meshlm.gateway.sse_direct import DirectSend
from meshlm.gateway.state import GatewayState
from meshlm.v1 import tokenizer_pb2

logger = logging.getLogger(__name__)


async def collect(st: GatewayState, greq: tokenizer_pb2.GenerateRequest) -> dict[int, Output]:
    """Run Generate to the end; an aborted output becomes the HTTP error of its status code."""
    stream = await st.pool.generate(greq, timeout=st.config.request_timeout_s)
    outputs: dict[int, Output] = {}
    try:
        async for response in stream:
            out = outputs.get(response.index) or outputs.setdefault(response.index, Output(response.index))
            out.add(response)
            if out.abort is not None:
                raise abort_error(out.abort)
    finally:
        stream.cancel()
    return outputs


async def run_generate(request: Request, st: GatewayState, greq: tokenizer_pb2.GenerateRequest) -> dict[int, Output]:
    return await cancel_on_disconnect(request, collect(st, greq))


async def open_stream(request: Request, st: GatewayState, greq: tokenizer_pb2.GenerateRequest) -> GenerateStream | None:
    """Start a streaming Generate and wait for its first response (an error before any output is an
    HTTP error, not an SSE event); None if the client left meanwhile."""
    try:
        return await cancel_on_disconnect(request, st.pool.generate(greq, timeout=st.config.request_timeout_s))
    except ClientDisconnected:
        return None


async def open_sse_stream(
    request: Request, st: GatewayState, greq: tokenizer_pb2.GenerateRequest
) -> GenerateStream | Response:
    """open_stream for an SSE route: the stream, a 499 response if the client left, or the HTTP
    error of a request aborted before any output (bad input is a 400, not an SSE event)."""
    stream = await open_stream(request, st, greq)
    if stream is None:
        return disconnected()
    abort = first_abort(stream.first)
    if abort is not None:
        stream.cancel()
        raise abort_error(abort)
    return stream


ChoiceEvents = Callable[[Output, tokenizer_pb2.GenerateResponse, bool], Iterable[str]]


async def choice_events(
    stream: GenerateStream,
    on_response: ChoiceEvents,
    on_done: Callable[[dict[int, Output]], Iterable[str]],
    direct: DirectSend | None = None,
) -> AsyncIterator[str]:
    """The SSE body of both OpenAI streams. Each response updates its choice's Output (index ->
    Output) and yields on_response(out, response, first-of-its-choice); an abort ends the stream
    with an error event, a completed stream with on_done(outputs). A service error becomes an
    error event; the stream is always cancelled and the body always ends with [DONE].

    With `direct` (bound by the response) and a stream that can deliver directly, a running
    choice's responses are handled where they arrive and their events written through `direct`
    (sse_direct): this task wakes only for a choice's last response, the end, or a send that had
    to wait, whose held events it sends first. Both paths run the same handling, in order."""
    outputs: dict[int, Output] = {}

    def handle(response: tokenizer_pb2.GenerateResponse) -> Iterable[str]:
        first = response.index not in outputs
        out = outputs.get(response.index) or outputs.setdefault(response.index, Output(response.index))
        out.add(response)
        if out.abort is not None:
            raise abort_error(out.abort)
        return on_response(out, response, first)

    failed: list[BaseException] = []  # what direct handling raised (the stream was cancelled)

    def deliver(response: tokenizer_pb2.GenerateResponse) -> bool:
        assert direct is not None
        if response.finished or not direct.ready:
            return False  # a last response (finish reason, abort, usage) goes through this task
        try:
            for event in handle(response):
                direct.write(event)
        except Exception as e:  # in the call's reader: end this stream, not the call
            logger.exception("SSE stream %s: handling a response failed", response.meta_info.id)
            failed.append(e)
            stream.cancel()
        return True

    try:
        response = stream.first
        stream.first = None
        while True:
            if response is not None:
                for event in handle(response):
                    yield event
            error: ServiceError | None = None
            if direct is not None and direct.ready:
                stream.set_direct(deliver)
            try:
                response = await stream.next_response()
            except ServiceError as e:
                error = e
            finally:
                stream.set_direct(None)
            if direct is not None:  # what direct delivery left goes first
                for event in await direct.resume():
                    yield event
            if failed:
                raise APIError(500, f"the gateway failed to stream this response: {failed[0]!r}")
            if error is not None:
                raise error
            if response is None:
                break
        for event in on_done(outputs):
            yield event
    except APIError as e:
        yield sse_error(e.status, e.message)
    except ServiceError as e:
        yield sse_error(e.http_status, e.message)
    finally:
        stream.cancel()
    yield SSE_DONE


def choices_sse_response(
    stream: GenerateStream, on_response: ChoiceEvents, on_done: Callable[[dict[int, Output]], Iterable[str]]
) -> SSEResponse:
    """The SSE response of an OpenAI stream: choice_events over `stream` with direct delivery
    (the DirectSend the response binds to its send), cancelling the stream however it ends."""
    direct = DirectSend()
    return sse_response(choice_events(stream, on_response, on_done, direct), stream.cancel, direct)


def json_response(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def disconnected() -> Response:
    return Response(status_code=499)
