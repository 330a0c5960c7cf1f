"""The TokenizerManager's control plane: model info (cached), server info, loads (each
scheduler's latest load report, SGLang's GetLoads), FlushCache fan-out, and sessions
(OpenSession picks a scheduler and names it in the id, `s<j>-<uuid hex>`, so any tokenizer
replica routes later turns and CloseSession to the same scheduler)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc

from meshlm.common.errors import ServiceError
from meshlm.tokenizer import limits
from meshlm.tokenizer.scheduler_client import SchedulerConnection
from meshlm.tokenizer.state import error_from_finish, error_reason, invalid
from meshlm.v1 import common_pb2, scheduler_pb2, tokenizer_pb2

if TYPE_CHECKING:
    from meshlm.tokenizer.manager import TokenizerManager

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("meshlm")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


class ControlPlane:
    def __init__(self, manager: TokenizerManager) -> None:
        self.m = manager
        self.model_info: common_pb2.ModelInfo | None = None

    @property
    def timeout(self) -> float:
        return self.m.config.connect_timeout_s

    # ---- model info -----------------------------------------------------------------------
    async def get_model_info(self, refresh: bool = False) -> common_pb2.ModelInfo:
        """A scheduler's GetModelInfo (connected schedulers first), cached; with the served
        model name and tokenizer path of this tokenizer."""
        if self.model_info is not None and not refresh:
            return self.model_info
        errors = []
        for conn in sorted(self.m.schedulers.connections, key=lambda c: not c.connected):
            try:
                info = await conn.get_model_info(self.timeout)
                break
            except ServiceError as e:
                errors.append(e.message)
        else:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "no scheduler answered GetModelInfo: " + ("; ".join(errors) or "no schedulers"),
            )
        if self.m.config.served_model_name:
            info.served_model_name = self.m.config.served_model_name
        elif not info.served_model_name:
            info.served_model_name = info.model_path
        if self.m.tokenizer is not None:
            info.tokenizer_path = str(self.m.tokenizer.path)
        self.model_info = info
        return info

    async def refresh_model_info(self) -> None:
        try:
            await self.get_model_info(refresh=True)
        except ServiceError as e:
            logger.debug("model info not available yet: %s", e.message)

    async def prefetch_model_info(self) -> None:
        """Until the first success: fetch the model info whenever a scheduler is connected."""
        while self.model_info is None:
            if self.m.schedulers.connected():
                await self.refresh_model_info()
            await asyncio.sleep(1.0)

    async def get_server_info(self) -> tokenizer_pb2.ServerInfo:
        try:
            model = await self.get_model_info()
        except ServiceError:
            model = common_pb2.ModelInfo()
        conns = self.m.schedulers.connections
        loads = [c.load if c.load is not None else common_pb2.SchedulerLoad(scheduler_id=c.address) for c in conns]
        config = json.loads(self.m.config.to_json())
        config["scheduler_endpoints"] = [
            {"index": c.index, "address": c.address, "connected": c.connected} for c in conns
        ]
        config["detokenizer_endpoints"] = [
            {"address": a, "connected": s.connected} for a, s in self.m.detokenizers.subscriptions.items()
        ]
        config["in_flight_requests"] = len(self.m.states)
        config["draining"] = self.m.draining
        return tokenizer_pb2.ServerInfo(
            model=model,
            schedulers=loads,
            version=_version(),
            tokenizer_id=self.m.origin,
            config_json=json.dumps(config, sort_keys=True),
        )

    # ---- loads ----------------------------------------------------------------------------
    def get_loads(self, dp_rank: int | None = None) -> tokenizer_pb2.GetLoadsResponse:
        """Every scheduler's latest load report as this tokenizer last heard it (reports arrive
        every ~0.5 s while a scheduler is busy, ~2 s when idle), in scheduler-index order; with
        `dp_rank`, only that scheduler (INVALID_ARGUMENT when there is none of that index)."""
        conns = self.m.schedulers.connections
        if dp_rank is not None and not 0 <= dp_rank < len(conns):
            raise invalid(f"dp_rank must be in [0, {len(conns) - 1}] (the schedulers' indices), got {dp_rank}")
        now = time.monotonic()
        reports = [
            tokenizer_pb2.SchedulerLoadReport(
                dp_rank=c.index,
                address=c.address,
                connected=c.connected,
                load=c.load,
                report_age_s=now - c.load_at if c.load is not None else 0.0,
            )
            for c in conns
            if dp_rank is None or c.index == dp_rank
        ]
        return tokenizer_pb2.GetLoadsResponse(
            schedulers=reports,
            tokenizer_id=self.m.origin,
            in_flight_requests=len(self.m.states),
            max_queued_requests=self.m.config.max_queued_requests,
            version=_version(),
        )

    # ---- FlushCache -----------------------------------------------------------------------
    async def flush_cache(self) -> tokenizer_pb2.FlushCacheResponse:
        """Every scheduler flushes; success only if all of them did."""
        conns = list(self.m.schedulers.connections)
        if not conns:
            return tokenizer_pb2.FlushCacheResponse(success=False, message="no schedulers")

        async def one(conn: SchedulerConnection) -> tuple[bool, str]:
            msg = scheduler_pb2.SchedulerInput(flush_cache=scheduler_pb2.FlushCacheReq())
            try:
                out = await conn.call(msg, self.timeout)
            except ServiceError as e:
                return False, e.message
            if out.WhichOneof("msg") != "flush_cache":
                return False, f"unexpected reply {out.WhichOneof('msg')}"
            return out.flush_cache.success, out.flush_cache.message

        results = await asyncio.gather(*(one(c) for c in conns))
        failed = [f"{c.scheduler_id}: {msg or 'failed'}" for c, (ok, msg) in zip(conns, results, strict=True) if not ok]
        if failed:
            return tokenizer_pb2.FlushCacheResponse(success=False, message="cache not flushed on " + "; ".join(failed))
        return tokenizer_pb2.FlushCacheResponse(success=True, message=f"flushed {len(conns)} scheduler(s)")

    # ---- sessions -------------------------------------------------------------------------
    async def open_session(self, request: tokenizer_pb2.OpenSessionRequest) -> str:
        self.m.check_accepting()
        if request.capacity_of_str_len < 0:
            raise invalid(f"capacity_of_str_len must be >= 0, got {request.capacity_of_str_len}")
        limits.check_id("session_id", request.session_id)
        if not await self.m.schedulers.wait_any_connected(self.timeout):
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no scheduler is connected")
        if request.session_id:
            session_id = request.session_id
            conn = self.m.dispatch.route(session_id)
        else:
            conn = self.m.dispatch.route()
            session_id = f"s{conn.index}-{uuid.uuid4().hex}"
        out = await conn.call(
            scheduler_pb2.SchedulerInput(
                open_session=scheduler_pb2.OpenSessionReq(
                    session_id=session_id, capacity_of_str_len=request.capacity_of_str_len
                )
            ),
            self.timeout,
        )
        kind = out.WhichOneof("msg")
        if kind == "error":
            raise error_from_finish(session_id, error_reason(out.error))
        if kind != "open_session" or not out.open_session.success:
            why = out.open_session.message if kind == "open_session" else f"unexpected reply {kind}"
            raise invalid(f"session_id {session_id!r} could not be opened: {why}")
        return out.open_session.session_id or session_id

    async def close_session(self, session_id: str) -> None:
        if not session_id:
            raise invalid("session_id is empty")
        limits.check_id("session_id", session_id)
        conn = self.m.dispatch.route(session_id)
        out = await conn.call(
            scheduler_pb2.SchedulerInput(close_session=scheduler_pb2.CloseSessionReq(session_id=session_id)),
            self.timeout,
        )
        kind = out.WhichOneof("msg")
        unknown = ServiceError(grpc.StatusCode.NOT_FOUND, f"session_id {session_id!r} is unknown")
        if kind == "ack" and not out.ack:  # the scheduler has no such session
            raise unknown
        if kind == "error":
            if out.error.reason.status_code in (0, 404):
                raise unknown
            raise error_from_finish(session_id, error_reason(out.error))
