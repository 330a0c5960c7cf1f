"""BadMessageInterceptor: a request that does not parse is INVALID_ARGUMENT, not UNKNOWN.

grpc answers a request its deserializer cannot parse (corrupt wire format, a proto3 string that
is not valid UTF-8, nesting too deep) with UNKNOWN "Unexpected DecodeError". Every GrpcServer
installs this interceptor, innermost: for each unary-request method it hands the raw bytes to a
wrapper that parses them itself and aborts with INVALID_ARGUMENT naming the method and the
message type on failure; the servicer then runs on the parsed message exactly as before.
Methods with a request stream (the ring's Connect / Push / Subscribe, reflection) are left as they
are: their messages come from our own services.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Parse = Callable[[bytes], Any]


async def _parse(parse: Parse, raw: bytes, context: grpc.aio.ServicerContext, method: str) -> Any:
    try:
        return parse(raw)
    except Exception as e:  # DecodeError, RecursionError: the bytes are not the request message
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request is not a valid message ({type(e).__name__}: {e})",
        )


def _unary_unary(behavior: Callable[..., Awaitable[Any]], parse: Parse, method: str) -> Callable[..., Any]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await _parse(parse, raw, context, method), context)

    return handle


def _unary_stream(behavior: Callable[..., Any], parse: Parse, method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await _parse(parse, raw, context, method)
            async for response in behavior(request, context):
                yield response

        return stream

    async def write(raw: bytes, context: grpc.aio.ServicerContext) -> Any:  # context.write() style
        return await behavior(await _parse(parse, raw, context, method), context)

    return write


class BadMessageInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Parses unary requests itself; see the module docstring."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _unary_stream(handler.unary_stream, parse, method),
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _unary_unary(handler.unary_unary, parse, method),
            response_serializer=handler.response_serializer,
        )
