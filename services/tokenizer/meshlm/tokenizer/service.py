"""meshlm.v1.TokenizerService: a thin gRPC adapter over TokenizerManager, and `serve(config)`.

`start_server` builds the manager, the servicer and the gRPC server, each given what it needs
in its constructor, and returns them with the health-tracking task as a `RunningTokenizer`
(which owns that task: nothing is attached to the manager from outside).

Errors leave as `context.abort(code, message)` with the code of meshlm.common.errors; the
message names the field and the limit. A rule's InvalidArgument (meshlm.common.input_limits) is
INVALID_ARGUMENT wherever it is raised; other unexpected exceptions become INTERNAL (logged):
grpc_status.status_of, which GenerateStream's streams share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from meshlm.common.errors import ServiceError
from meshlm.common.gc_heap import freeze_startup_heap
from meshlm.common.grpc_server import GrpcServer
from meshlm.common.log import setup_logging
from meshlm.common.metrics import Metrics
from meshlm.common.telemetry import setup_telemetry, shutdown_telemetry
from meshlm.tokenizer.config import TokenizerConfig
from meshlm.tokenizer.generate_stream import GenerateStreamCall
from meshlm.tokenizer.grpc_status import status_of
from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.manager import TokenizerManager
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "meshlm.v1.TokenizerService"
T = TypeVar("T")


async def _unary(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return await fn()
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as e:
        await context.abort(*status_of(e, "a unary TokenizerService call"))
    raise AssertionError("unreachable")


async def _value(v: T) -> T:
    return v


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, manager: TokenizerManager) -> None:
        self.manager = manager

    async def Generate(
        self, request: tokenizer_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        try:
            async with contextlib.aclosing(self.manager.generate(request)) as outputs:
                async for response in outputs:
                    yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await context.abort(*status_of(e, "Generate"))

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.GenerateStreamResponse]:
        await context.send_initial_metadata(())  # the caller waits for it before its first write
        call = GenerateStreamCall(self.manager, self.manager.config.max_stream_backlog_bytes)
        try:
            async for response in call.run(request_iterator):
                yield response
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def Embed(
        self, request: tokenizer_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EmbedResponse:
        return await _unary(context, lambda: self.manager.embed(request))

    async def Abort(
        self, request: tokenizer_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.AbortResponse:
        async def run() -> tokenizer_pb2.AbortResponse:
            self.manager.abort(request.rid, request.abort_all)
            return tokenizer_pb2.AbortResponse()

        return await _unary(context, run)

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        return await _unary(context, lambda: _value(self.manager.tokenize(request)))

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        return await _unary(context, lambda: _value(self.manager.detokenize(request)))

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return await _unary(context, self.manager.control.get_model_info)

    async def GetServerInfo(
        self, request: tokenizer_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ServerInfo:
        return await _unary(context, self.manager.control.get_server_info)

    async def GetLoads(
        self, request: tokenizer_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.GetLoadsResponse:
        dp_rank = request.dp_rank if request.HasField("dp_rank") else None
        return await _unary(context, lambda: _value(self.manager.control.get_loads(dp_rank)))

    async def FlushCache(
        self, request: tokenizer_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.FlushCacheResponse:
        return await _unary(context, self.manager.control.flush_cache)

    async def OpenSession(
        self, request: tokenizer_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.OpenSessionResponse:
        async def run() -> tokenizer_pb2.OpenSessionResponse:
            return tokenizer_pb2.OpenSessionResponse(session_id=await self.manager.control.open_session(request))

        return await _unary(context, run)

    async def CloseSession(
        self, request: tokenizer_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.CloseSessionResponse:
        async def run() -> tokenizer_pb2.CloseSessionResponse:
            await self.manager.control.close_session(request.session_id)
            return tokenizer_pb2.CloseSessionResponse()

        return await _unary(context, run)


@dataclass
class RunningTokenizer:
    """A started tokenizer server (what `serve` runs; tests drive it directly). `readiness`:
    the task that keeps health in step with the peers (see _track_readiness)."""

    server: GrpcServer
    manager: TokenizerManager
    readiness: asyncio.Task[None]

    @property
    def port(self) -> int:
        return self.server.port

    async def close(self) -> None:
        """Stop tracking readiness, stop the gRPC server now, close the peer streams."""
        self.readiness.cancel()
        await asyncio.gather(self.readiness, return_exceptions=True)
        await self.server.stop(0)
        await self.manager.close()


async def start_server(
    config: TokenizerConfig,
    tokenizer: HFTokenizer | None = None,
    metrics: Metrics | None = None,
) -> RunningTokenizer:
    """Start the manager (peer streams), load the tokenizer, bind and start the gRPC server;
    health is SERVING only while the peers are (from the first status on)."""
    manager = TokenizerManager(config, tokenizer=tokenizer, metrics=metrics)
    await manager.start()
    try:
        await manager.load_tokenizer()
        server = GrpcServer(
            [SERVICE_NAME],
            config.host,
            config.port,
            tls=config.tls,
            health_port=config.health_port,
            auth=config.auth,
            public_services=[SERVICE_NAME],
        )
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(TokenizerServicer(manager), server.server)
        await server.start()
        serving = manager.peers_ready()
        await server.set_serving(serving)
        readiness = asyncio.create_task(_track_readiness(server, manager, serving), name="readiness")
    except BaseException:
        await manager.close()
        raise
    return RunningTokenizer(server, manager, readiness)


async def _track_readiness(server: GrpcServer, manager: TokenizerManager, serving: bool, period_s: float = 0.2) -> None:
    """Health follows the peers: SERVING only while a scheduler and a detokenizer are reachable,
    so Kubernetes (and `meshlm launch`) route traffic only to a tokenizer that can serve it.
    `serving` is the status last set: comparing against a fresh peers_ready() read instead would
    miss a change that happened between setting the status and starting this task."""
    while True:
        await asyncio.sleep(period_s)
        ready = manager.peers_ready()
        if ready != serving:
            await server.set_serving(ready)
            serving = ready


async def serve(config: TokenizerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain: NOT_SERVING, refuse new requests (UNAVAILABLE),
    let in-flight ones finish within grace_period_s (abort the rest), stop; returns 0."""
    setup_logging("tokenizer", config.log_level, config.log_format)
    setup_telemetry("meshlm-tokenizer", config.otlp_endpoint)
    metrics = Metrics()
    running = await start_server(config, metrics=metrics)
    server, manager = running.server, running.manager
    metrics.serve(config.metrics_port)
    freeze_startup_heap()
    logger.info(
        "tokenizer %s serving on port %d (schedulers %s, detokenizers %s)",
        config.tokenizer_id,
        server.port,
        ",".join(config.scheduler_addrs),
        ",".join(config.detokenizer_addrs),
    )

    async def on_drain() -> None:
        manager.start_draining()
        await manager.drain(max(0.0, config.grace_period_s - 1.0))

    try:
        await server.serve_until_signal(config.grace_period_s, on_drain)
    finally:
        await running.close()
        shutdown_telemetry()
    return 0
