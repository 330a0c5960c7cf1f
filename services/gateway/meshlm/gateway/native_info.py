"""SGLang's worker-information surface: /model_info, /server_info (SGLang's current names; the
older /get_model_info and /get_server_info answer the same), /v1/loads and /get_load.

These are what a model gateway in front of several workers reads (smg: `/server_info` marks the
worker as an SGLang runtime; `/v1/loads?include=...` feeds its load-aware policies), so the keys
follow SGLang's shapes. Loads are the schedulers' own load reports, as one tokenizer replica last
heard them (TokenizerService.GetLoads; every tokenizer connects to every scheduler, so any one has
the whole picture): a report is at most ~0.5 s old while a scheduler is busy, ~2 s when idle.
Only what meshlm measures is reported: no gen_throughput / utilization keys, and of the
sections SGLang's `include` names only `core` and `queues` carry data (memory, spec, lora, disagg
are accepted and empty).
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from meshlm.gateway.errors import bad_request
from meshlm.gateway.native_outputs import proto_dict
from meshlm.gateway.state import GatewayState, get_state
from meshlm.v1 import common_pb2, tokenizer_pb2

router = APIRouter(tags=["SGLang-native"])

LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")  # SGLang's names
MAX_INT32 = (1 << 31) - 1


async def _model_info_dict(st: GatewayState, info: common_pb2.ModelInfo) -> dict[str, Any]:
    out = proto_dict(info)
    out["served_model_name"] = await st.served_model_name()
    out["architectures"] = [info.architecture] if info.architecture else []
    out["has_image_understanding"] = False
    out["has_audio_understanding"] = False
    out["weight_version"] = "default"  # weights are never swapped while serving
    return out


async def model_info(request: Request) -> dict:
    """SGLang's /model_info: model and tokenizer paths, kind, context length, EOS ids."""
    st = get_state(request)
    return await _model_info_dict(st, await st.model_info())


async def server_info(request: Request) -> dict:
    """SGLang's /server_info: the model info, the serving settings SGLang names (dp_size,
    load_balance_method, max_total_tokens, max_running_requests, ...), one internal state per
    scheduler (its latest load), the version, and meshlm's own detail (tokenizer config,
    schedulers, gateway)."""
    st = get_state(request)
    info = await st.pool.get_server_info(timeout=st.control_timeout_s)
    out = await _model_info_dict(st, info.model)
    config: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        config = json.loads(info.config_json) if info.config_json else {}
    out["tokenizer_config"] = config
    schedulers = [proto_dict(s) for s in info.schedulers]
    reported = [s for s in info.schedulers if s.max_total_num_tokens > 0]
    out.update(
        is_embedding=not info.model.is_generation,
        dp_size=len(info.schedulers),
        load_balance_method=config.get("routing_policy", ""),
        version=info.version,
        tokenizer_id=info.tokenizer_id,
        internal_states=schedulers,
        schedulers=schedulers,
        gateway={"tokenizer_addrs": list(st.config.tokenizer_addrs), "request_timeout_s": st.config.request_timeout_s},
    )
    if info.model.context_length:
        out["context_length"] = info.model.context_length
    if reported:
        out["max_total_tokens"] = reported[0].max_total_num_tokens
        out["max_running_requests"] = reported[0].max_running_requests
    return out


for _path, _endpoint in (
    ("/model_info", model_info),
    ("/get_model_info", model_info),
    ("/server_info", server_info),
    ("/get_server_info", server_info),
):
    router.add_api_route(_path, _endpoint, methods=["GET"], name=_path.strip("/"))


# ---------------------------------------------------------------------------- loads


def _sections(include: str | None) -> set[str]:
    if not include:
        return {"all"}
    parts = {p.strip() for p in include.split(",") if p.strip()}
    unknown = sorted(parts - set(LOAD_SECTIONS))
    if unknown:
        raise bad_request(
            f"include: unknown section(s) {', '.join(unknown)}; valid: {', '.join(LOAD_SECTIONS)}", "include"
        )
    return parts or {"all"}


def load_dict(report: tokenizer_pb2.SchedulerLoadReport, sections: set[str], now: float) -> dict[str, Any]:
    """One scheduler's report in SGLang's per-DP-rank shape (GetLoadsReqOutput.to_dict)."""
    load = report.load
    out: dict[str, Any] = {"dp_rank": report.dp_rank, "timestamp": now - report.report_age_s}
    everything = "all" in sections
    if everything or "core" in sections:
        out.update(
            num_running_reqs=load.num_running_reqs,
            num_waiting_reqs=load.num_queue_reqs,
            num_total_reqs=load.num_running_reqs + load.num_queue_reqs,
            num_used_tokens=load.num_used_tokens,
            max_total_num_tokens=load.max_total_num_tokens,
            token_usage=load.token_usage,
            cache_hit_rate=load.cache_hit_rate,
            max_running_requests=load.max_running_requests,
            scheduler_id=load.scheduler_id or report.address,
            connected=report.connected,
            report_age_s=report.report_age_s,
        )
    if everything or "queues" in sections:
        out["queues"] = {"waiting": load.num_queue_reqs}
    return out


async def _get_loads(st: GatewayState, dp_rank: int | None) -> tokenizer_pb2.GetLoadsResponse:
    request = tokenizer_pb2.GetLoadsRequest()
    if dp_rank is not None:
        request.dp_rank = dp_rank
    return await st.pool.get_loads(request, timeout=st.control_timeout_s)


@router.get("/v1/loads")
async def v1_loads(
    request: Request,
    dp_rank: int | None = Query(None, ge=0, le=MAX_INT32, description="only this scheduler (data-parallel rank)"),
    include: str | None = Query(None, description=f"comma-separated sections: {', '.join(LOAD_SECTIONS)}"),
    format: Literal["json", "prometheus"] = Query("json", description="json (default) or prometheus text"),
) -> Response:
    """SGLang's /v1/loads: one entry per scheduler that has reported its load."""
    sections = _sections(include)
    reply = await _get_loads(get_state(request), dp_rank)
    now = time.time()
    loads = [load_dict(r, sections, now) for r in reply.schedulers if r.HasField("load")]
    if format == "prometheus":
        return PlainTextResponse(_prometheus(loads), media_type="text/plain; version=0.0.4; charset=utf-8")
    return JSONResponse(
        {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": reply.version,
            "dp_rank_count": len(reply.schedulers),
            "loads": loads,
        }
    )


def _prometheus(loads: list[dict[str, Any]]) -> str:
    """SGLang's text form: one gauge per numeric key, `sglang_<key>{dp_rank="i"}` (sections as
    `sglang_<section>_<key>`)."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if key == "dp_rank":
                continue
            items = [(f"{key}_{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
            for name, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    samples.setdefault(f"sglang_{name}", []).append((rank, v))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values)
    return "\n".join(lines) + "\n"


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    """SGLang's older /get_load: per scheduler {dp_rank, num_reqs (running + waiting),
    num_waiting_reqs, num_tokens (KV tokens in use)}."""
    reply = await _get_loads(get_state(request), None)
    return [
        {
            "dp_rank": r.dp_rank,
            "num_reqs": r.load.num_running_reqs + r.load.num_queue_reqs,
            "num_waiting_reqs": r.load.num_queue_reqs,
            "num_tokens": r.load.num_used_tokens,
        }
        for r in reply.schedulers
        if r.HasField("load")
    ]
