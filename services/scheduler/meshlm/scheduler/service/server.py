"""The scheduler service process: engine loop + gRPC SchedulerService + detokenizer Push
stream + metrics, with graceful drain on SIGTERM.

    python -m meshlm.scheduler --detokenizer-addrs detok:30020 [--port 30010] [engine flags]

Start-up: load the model (SchedulerRuntime, as the in-process Engine does), start the loop
thread and the Push client, then bind gRPC and report SERVING. SIGTERM: NOT_SERVING, new
requests rejected (503), running requests finish within --grace-period-s, the rest fail with
503, outputs are flushed to the detokenizer, streams end, exit 0. A crash of the loop fails
every request (500) and exits 1.

With --disaggregation-mode prefill the service also keeps Connect streams to the decode
schedulers of --decode-addrs (PrefillHandover) and hands each prefilled request to one.
The servicer's parts are built and wired here, by constructor (`_build_servicer`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence

from meshlm.common import event_loop, telemetry
from meshlm.common.cpus import batch_scheduling
from meshlm.common.gc_heap import freeze_startup_heap
from meshlm.common.grpc_server import GrpcServer
from meshlm.common.log import setup_logging
from meshlm.common.metrics import Metrics
from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.cpu_budget import apply_cpu_budget
from meshlm.scheduler.runtime import SchedulerRuntime
from meshlm.scheduler.service.config import SchedulerServiceConfig, parse_args
from meshlm.scheduler.service.connections import ConnectionRegistry
from meshlm.scheduler.service.control import ControlCalls
from meshlm.scheduler.service.detok_client import DetokenizerPushClient
from meshlm.scheduler.service.endings import RequestEnds
from meshlm.scheduler.service.lifecycle import ServiceState
from meshlm.scheduler.service.load import LoadReporter
from meshlm.scheduler.service.observability import RequestObserver, SchedulerMetrics
from meshlm.scheduler.service.pd_handover import PrefillHandover
from meshlm.scheduler.service.servicer import SchedulerServicer
from meshlm.scheduler.service.tracker import RequestTracker
from meshlm.v1 import common_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)
_IMPORTED_AT = time.monotonic()  # the fallback clock where /proc is unreadable

SERVICE_NAME = "meshlm.v1.SchedulerService"


def model_info(runtime: SchedulerRuntime) -> common_pb2.ModelInfo:
    mc, cfg = runtime.model_config, runtime.config
    path = cfg.model_path or mc.path
    return common_pb2.ModelInfo(
        model_path=path,
        tokenizer_path=cfg.tokenizer_path or path,
        served_model_name=mc.served_name,
        is_generation=not mc.is_embedding,
        context_length=mc.context_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=list(mc.eos_token_ids),
        architecture=mc.architecture,
        max_req_input_len=runtime.scheduler.max_req_len,
    )


def process_uptime_s() -> float:
    """Seconds since this process started (Linux /proc: the kernel's start time, so the
    interpreter and the imports count); elsewhere since this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


class SchedulerServer:
    """One scheduler service in this process. `await start()`, then `serve_until_signal()`
    (the process) or `shutdown()` (tests)."""

    def __init__(self, svc: SchedulerServiceConfig, engine: SchedulerConfig) -> None:
        self.svc = svc
        self.engine_config = engine
        self.exit_code = 0
        self.port = 0
        self.scheduler_id = ""
        self.metrics = Metrics()
        self.tracker = RequestTracker()
        self.runtime: SchedulerRuntime | None = None
        self.servicer: SchedulerServicer | None = None
        self.detok: DetokenizerPushClient | None = None
        self.handover: PrefillHandover | None = None
        self._ready_task: asyncio.Task | None = None
        self.grpc: GrpcServer | None = None
        self._closed = False

    async def start(self) -> int:
        """Load the model, start the loop, the Push client and gRPC; returns the bound port."""
        svc = self.svc
        logger.info("start-up: interpreter and imports took %.2fs", process_uptime_s())
        # The model loads in a worker thread so the event loop stays responsive.
        runtime = await asyncio.to_thread(SchedulerRuntime, self.engine_config, self._on_output, self._on_control)
        self.runtime = runtime
        self.grpc = GrpcServer(
            [SERVICE_NAME], svc.host, svc.port, tls=svc.tls, health_port=svc.health_port, auth=svc.auth
        )
        self.port = self.grpc.bind()
        self.scheduler_id = svc.resolved_scheduler_id(self.port)
        self.servicer = self._build_servicer(runtime)
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, self.grpc.server)
        if self.handover is not None:
            self.handover.start()
        self.servicer.start()
        assert self.detok is not None
        self.detok.start()
        runtime.start(on_crash=self.servicer.on_crash)
        await self.grpc.start()
        if self.handover is not None and not self.handover.any_up():
            # A prefill scheduler is of no use before a decode scheduler takes its requests.
            await self.grpc.set_serving(False)
            self._ready_task = asyncio.create_task(self._serve_when_decode_up(), name="decode-ready")
        self.metrics.serve(svc.metrics_port)
        logger.info(
            "scheduler %s serving on port %d (model %s, KV %d tokens, role %s, detokenizers %s%s): "
            "ready in %.1fs after the process started",
            self.scheduler_id,
            self.port,
            runtime.config.model_path,
            runtime.scheduler.max_total_num_tokens,
            self.engine_config.disaggregation_mode,
            ",".join(svc.detokenizer_addrs) or "-",
            f", decode schedulers {','.join(svc.decode_addrs)}" if self.handover else "",
            process_uptime_s(),
        )
        return self.port

    def _build_servicer(self, runtime: SchedulerRuntime) -> SchedulerServicer:
        """Wire the servicer's parts (the scheduler id is known: the port is bound)."""
        svc, sid, put = self.svc, self.scheduler_id, runtime.port.put
        state, connections = ServiceState(), ConnectionRegistry()
        metrics = SchedulerMetrics(self.metrics)
        grammar_pool = runtime.scheduler.parts.grammar.pool
        if grammar_pool is not None:  # compiles run on the pool's threads; prometheus is thread-safe
            grammar_pool.on_compiled = metrics.grammar_compilation_time.observe
        if self.engine_config.disaggregation_mode == "prefill":
            # The prefill side's own failures have nothing left to abort downstream.
            local_ends = RequestEnds(put, self.tracker, connections)
            self.handover = PrefillHandover(
                sid,
                svc.decode_addrs,
                tracker=self.tracker,
                ends=local_ends,
                tls=svc.tls,
                token=svc.auth.internal_token_value,
            )
        ends = RequestEnds(put, self.tracker, connections, downstream=self.handover)
        unavailable = f"scheduler {sid}: no detokenizer reachable"
        self.detok = DetokenizerPushClient(
            sid,
            svc.detokenizer_addrs,
            self.tracker,
            lambda rids: ends.fail_rids(rids, unavailable, 503),
            fail_after_s=svc.detokenizer_timeout_s,
            tls=svc.tls,
            token=svc.auth.internal_token_value,
        )
        calls = ControlCalls(put, connections, sid)
        load = LoadReporter(
            sid,
            calls=calls,
            connections=connections,
            tracker=self.tracker,
            state=state,
            metrics=metrics,
            interval_s=svc.load_report_interval_s,
        )
        return SchedulerServicer(
            put,
            scheduler_id=sid,
            model_info=model_info(runtime),
            state=state,
            tracker=self.tracker,
            connections=connections,
            calls=calls,
            load=load,
            ends=ends,
            detok=self.detok,
            observer=RequestObserver(metrics, sid),
            handover=self.handover,
            on_fatal=self._fatal,
        )

    async def _serve_when_decode_up(self) -> None:
        assert self.handover is not None and self.grpc is not None
        while not await self.handover.wait_up(30.0):
            logger.warning("no decode scheduler of %s is reachable yet", ",".join(self.svc.decode_addrs))
        if not self._closed and not (self.servicer and self.servicer.state.draining):
            await self.grpc.set_serving(True)

    # loop-thread callbacks, bound before the servicer exists
    def _on_output(self, msg: object) -> None:
        if self.servicer is not None:
            self.servicer.on_output(msg)

    def _on_control(self, msg: object) -> None:
        if self.servicer is not None:
            self.servicer.on_control(msg)

    def _fatal(self) -> None:
        """The loop crashed: report NOT_SERVING and stop (the process exits 1)."""
        self.exit_code = 1

        async def stop() -> None:
            assert self.grpc is not None
            await self.grpc.set_serving(False)
            await asyncio.sleep(0.2)  # let the errors reach the tokenizers
            await self.grpc.stop(1.0)

        asyncio.get_running_loop().create_task(stop())

    async def _drain_hook(self) -> None:
        assert self.servicer is not None
        await self.servicer.drain(self.svc.grace_period_s)

    async def serve_until_signal(self) -> int:
        """Serve until SIGTERM/SIGINT (drain) or a fatal error; returns the exit code."""
        assert self.grpc is not None
        await self.grpc.serve_until_signal(self.svc.grace_period_s, self._drain_hook)
        await self.close()
        return self.exit_code

    async def shutdown(self, grace_s: float | None = None) -> None:
        """What SIGTERM does: drain within grace_s, then stop everything."""
        assert self.grpc is not None and self.servicer is not None
        grace = self.svc.grace_period_s if grace_s is None else grace_s
        await self.grpc.drain(grace, lambda: self.servicer.drain(grace))  # type: ignore[union-attr]
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self.servicer is not None:
            await self.servicer.stop()
        if self.detok is not None:
            await self.detok.close()
        if self.handover is not None:
            await self.handover.close()
        if self.grpc is not None:
            await self.grpc.stop(0)
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.stop, 10.0)


def serve(svc: SchedulerServiceConfig, engine: SchedulerConfig) -> int:
    """Run the service in this process until SIGTERM; returns the exit code."""
    setup_logging("scheduler", svc.log_level, svc.log_format)
    telemetry.setup_telemetry("meshlm-scheduler", svc.otlp_endpoint)
    apply_cpu_budget()  # a container's CPU quota, not the node's cores, sizes the thread pool

    async def run() -> int:
        server = SchedulerServer(svc, engine)
        try:
            await server.start()
        except BaseException:
            await server.close()
            raise
        freeze_startup_heap()  # after the model load: its Python objects too
        return await server.serve_until_signal()

    try:
        return event_loop.run(run())
    finally:
        telemetry.shutdown_telemetry()


def main(argv: Sequence[str] | None = None) -> int:
    """`meshlm serve scheduler ARGS` / `python -m meshlm.scheduler ARGS`."""
    svc, engine = parse_args(argv)
    if svc.batch_scheduling:
        batch_scheduling()
    if not svc.detokenizer_addrs:
        raise SystemExit("--detokenizer-addrs (or MESHLM_SCHEDULER_DETOKENIZER_ADDRS) is required")
    if (engine.disaggregation_mode == "prefill") != bool(svc.decode_addrs):
        raise SystemExit("--decode-addrs is required with --disaggregation-mode prefill, and only then")
    return serve(svc, engine)
