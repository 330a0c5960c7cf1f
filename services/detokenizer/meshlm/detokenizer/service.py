"""The gRPC edge of the detokenizer: `DetokenizerServicer` (Push, Subscribe) and `serve`.

The servicer only moves messages between gRPC and `DetokenizerManager`; every stream opens with
a Hello, and a peer of another protocol version is refused (FAILED_PRECONDITION). Drain
(SIGTERM): health NOT_SERVING, Push streams end (their schedulers move to another detokenizer
and re-send), every Subscribe stream ends after what is queued for it has been sent, then the
server stops; exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from meshlm.common import protocol
from meshlm.common.errors import ServiceError
from meshlm.common.gc_heap import freeze_startup_heap
from meshlm.common.grpc_server import GrpcServer
from meshlm.common.telemetry import setup_telemetry, shutdown_telemetry
from meshlm.detokenizer.config import DetokenizerConfig
from meshlm.detokenizer.decoder import TextDecoder, TokenizerDecoder
from meshlm.detokenizer.manager import DetokenizerManager
from meshlm.detokenizer.metrics import DetokenizerMetrics
from meshlm.v1 import detokenizer_pb2, detokenizer_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "meshlm.v1.DetokenizerService"
TELEMETRY_NAME = "meshlm-detokenizer"


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    """Push: a scheduler's steps into the manager. Subscribe: one origin's outputs out."""

    def __init__(self, manager: DetokenizerManager) -> None:
        self.manager = manager
        self._pushes: set[asyncio.Task] = set()
        self._ending = False  # end_pushes ran: a cancelled Push ends with UNAVAILABLE

    async def Push(
        self,
        request_iterator: AsyncIterator[detokenizer_pb2.DetokenizerInput],
        context: grpc.aio.ServicerContext,
    ) -> detokenizer_pb2.PushSummary:
        if self.manager.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "detokenizer is draining; push to another replica")
        task = asyncio.current_task()
        if task is not None:
            self._pushes.add(task)
        count, scheduler_id = 0, "?"
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                count += 1
                if count == 1:
                    try:
                        scheduler_id = protocol.check_hello(kind, msg.hello, "detokenizer", "Push")
                    except ServiceError as e:
                        logger.warning("refused a Push stream: %s", e.message)
                        await context.abort(e.code, e.message)
                    logger.info("scheduler %s connected", scheduler_id)
                    continue
                if kind == "hello":
                    logger.warning("scheduler %s sent hello twice; ignored", scheduler_id)
                    continue
                try:
                    if kind == "tokens":
                        self.manager.handle_tokens(msg.tokens)
                    elif kind == "embeddings":
                        self.manager.handle_embeddings(msg.embeddings)
                except Exception:  # a bad message must not end the stream of every other request
                    logger.exception("cannot handle a %s message from scheduler %s", kind, scheduler_id)
        except asyncio.CancelledError:
            if self._ending:  # a status the scheduler sees at once, not a call left without one
                await context.abort(grpc.StatusCode.UNAVAILABLE, "detokenizer is draining; push to another replica")
            raise
        finally:
            self._pushes.discard(task)
            logger.info("push stream of scheduler %s ended after %d message(s)", scheduler_id, count)
        return detokenizer_pb2.PushSummary(messages=count)

    async def Subscribe(
        self, request: detokenizer_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[detokenizer_pb2.DetokenizerOutput]:
        kind = "hello" if request.HasField("hello") else None
        try:
            origin = protocol.check_hello(kind, request.hello, "detokenizer", "Subscribe")
        except ServiceError as e:
            logger.warning("refused a Subscribe stream: %s", e.message)
            await context.abort(e.code, e.message)
        if self.manager.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "detokenizer is draining; subscribe to another replica")
        logger.info("origin %s subscribed", origin)
        async with contextlib.aclosing(self.manager.stream(origin)) as outputs:
            async for msg in outputs:
                yield msg

    def end_pushes(self) -> None:
        """End every Push stream with UNAVAILABLE (drain): schedulers see it and move on."""
        self._ending = True
        for task in list(self._pushes):
            task.cancel()


@dataclass
class RunningDetokenizer:
    """A started detokenizer server (what `serve` runs; tests drive it directly)."""

    server: GrpcServer
    servicer: DetokenizerServicer
    manager: DetokenizerManager
    port: int
    sweeper: asyncio.Task

    async def on_drain(self) -> None:
        self.servicer.end_pushes()
        await self.manager.drain()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain and stop (as on SIGTERM)."""
        await self.server.drain(grace_s, self.on_drain)
        self.sweeper.cancel()


async def start_detokenizer(
    config: DetokenizerConfig,
    decoder: TextDecoder | None = None,
    metrics: DetokenizerMetrics | None = None,
) -> RunningDetokenizer:
    """Load the tokenizer (unless given), build the manager and servicer, start the server."""
    decoder = decoder or TokenizerDecoder.from_path(config.tokenizer_path)
    manager = DetokenizerManager(
        decoder,
        max_states=config.max_states,
        undelivered_hold_s=config.undelivered_hold_s,
        metrics=metrics,
    )
    servicer = DetokenizerServicer(manager)
    server = GrpcServer(
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        tls=config.tls,
        health_port=config.health_port,
        auth=config.auth,
    )
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, server.server)
    port = await server.start()
    sweeper = asyncio.create_task(manager.run_sweeper(min(1.0, max(config.undelivered_hold_s / 4, 0.05))))
    return RunningDetokenizer(server, servicer, manager, port, sweeper)


async def serve(config: DetokenizerConfig) -> None:
    """Run the detokenizer until SIGTERM/SIGINT, then drain and return."""
    setup_telemetry(TELEMETRY_NAME, config.otlp_endpoint)
    metrics = DetokenizerMetrics()
    metrics.serve(config.metrics_port)
    running = await start_detokenizer(config, metrics=metrics)
    freeze_startup_heap()
    logger.info(
        "detokenizer serving on %s:%d (tokenizer %s)",
        config.host,
        running.port,
        config.tokenizer_path,
    )
    try:
        await running.server.serve_until_signal(config.grace_period_s, running.on_drain)
    finally:
        running.sweeper.cancel()
        shutdown_telemetry()
