"""SGLang-native routes: /generate, /encode, /health, /health_generate, /flush_cache,
/abort_request, /open_session, /close_session (model / server info and loads: native_info.py).

/generate follows SGLang's GenerateReqInput: a single prompt gives a dict, a batch (list of texts or
of id lists) or n > 1 a list; streaming sends `data: {text, output_ids, meta_info[, index]}` with
cumulative text and ids (SGLang's default) and ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from meshlm.common.deadline import within
from meshlm.common.errors import ServiceError
from meshlm.common.log import request_id_var
from meshlm.gateway.errors import APIError, bad_request, error_response
from meshlm.gateway.grpc_client import (
    ClientDisconnected,
    GenerateStream,
    cancel_on_disconnect,
    sampling_params,
    trace_context,
)
from meshlm.gateway.json_body import StrictJsonRoute
from meshlm.gateway.native_outputs import native_output
from meshlm.gateway.native_protocol import (
    AbortReq,
    CloseSessionReq,
    EmbeddingReqInput,
    GenerateReqInput,
    NativeSamplingParams,
    OpenSessionReq,
)
from meshlm.gateway.outputs import (
    SSE_DONE,
    Output,
    abort_error,
    first_abort,
    sse,
    sse_response,
)
from meshlm.gateway.state import GatewayState, get_state
from meshlm.v1 import common_pb2, tokenizer_pb2

router = APIRouter(tags=["SGLang-native"], route_class=StrictJsonRoute)


def route(path: str, methods: list[str]) -> Any:
    """One route for several methods; the OpenAPI document lists the first (operation ids stay unique)."""

    def register(endpoint: Any) -> Any:
        for i, method in enumerate(methods):
            router.add_api_route(path, endpoint, methods=[method], include_in_schema=i == 0)
        return endpoint

    return register


HEALTH_CHECK_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------- helpers


def _prompts(text: Any, input_ids: Any) -> tuple[list[tokenizer_pb2.Prompt], bool]:
    """(prompts, is_batch) from text | input_ids; exactly one must be given and none may be empty."""
    if (text is None) == (input_ids is None):
        raise bad_request("exactly one of text or input_ids must be given", "text")
    if text is not None:
        items, batch = ([text], False) if isinstance(text, str) else (text, True)
        if not items:
            raise bad_request("text: the batch must not be empty", "text")
        return [tokenizer_pb2.Prompt(text=t) for t in items], batch
    batch = bool(input_ids) and isinstance(input_ids[0], list)
    id_lists: list[list[int]] = input_ids if batch else [input_ids]
    if not id_lists or any(not ids for ids in id_lists):
        raise bad_request("input_ids must not be empty", "input_ids")
    return [tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=ids)) for ids in id_lists], batch


def _sampling(sp: NativeSamplingParams | None) -> common_pb2.SamplingParams:
    try:
        return sampling_params(sp.model_dump() if sp is not None else {})
    except (ValueError, TypeError) as e:
        raise bad_request(f"sampling_params: {e}", "sampling_params") from None


async def _open_all(
    st: GatewayState, calls: list[tokenizer_pb2.GenerateRequest], key: str | None
) -> list[GenerateStream]:
    tasks = [asyncio.ensure_future(st.pool.generate(c, timeout=st.config.request_timeout_s, key=key)) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
            if t.done() and not t.cancelled() and t.exception() is None:
                t.result().cancel()
        raise


async def _merged(
    streams: list[GenerateStream], offsets: list[int]
) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
    """Responses of every stream, index shifted by the stream's offset (one per prompt call)."""
    if len(streams) == 1:
        try:
            async for response in streams[0]:
                yield response
        finally:
            streams[0].cancel()
        return
    # A response, the error that ended a stream, or None: a stream ended cleanly.
    queue: asyncio.Queue[tokenizer_pb2.GenerateResponse | Exception | None] = asyncio.Queue()

    async def pump(stream: GenerateStream, offset: int) -> None:
        try:
            async for response in stream:
                response.index += offset
                await queue.put(response)
            await queue.put(None)
        except Exception as e:  # forwarded to the consumer
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(s, o)) for s, o in zip(streams, offsets, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.cancel()


# ---------------------------------------------------------------------------- /generate


@route("/generate", ["POST", "PUT"])
async def generate(body: GenerateReqInput, request: Request) -> Response:
    st = get_state(request)
    for name in ("input_embeds", "image_data", "lora_path"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported", name)
    prompts, batch = _prompts(body.text, body.input_ids)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else None
    one_sp = body.sampling_params if not isinstance(body.sampling_params, list) else None
    if sps is not None and len(sps) != len(prompts):
        raise bad_request(f"sampling_params: {len(sps)} given for {len(prompts)} prompts", "sampling_params")
    ns = {(sp.n or 1) for sp in sps} if sps else {(one_sp.n or 1) if one_sp else 1}
    if len(ns) > 1:
        raise bad_request("sampling_params: n must be the same for every prompt of a batch", "sampling_params")
    n = ns.pop()
    rids = body.rid if isinstance(body.rid, list) else None
    if rids is not None and (not batch or len(rids) != len(prompts)):
        raise bad_request(f"rid: a list needs one id per prompt ({len(prompts)})", "rid")
    base_rid = body.rid if isinstance(body.rid, str) else uuid.uuid4().hex
    request_id_var.set(base_rid)
    common: dict[str, Any] = dict(
        return_logprob=body.return_logprob,
        top_logprobs_num=body.top_logprobs_num,
        token_ids_logprob=body.token_ids_logprob or [],
        return_text_in_logprobs=body.return_text_in_logprobs,
        stream=body.stream,
        trace=trace_context(),
        session_id=body.session_params.id if body.session_params else "",
        session_rid=(body.session_params.rid or "") if body.session_params else "",
    )
    if body.logprob_start_len is not None and body.logprob_start_len >= 0:
        common["logprob_start_len"] = body.logprob_start_len
    if sps is None and rids is None:  # one call; the tokenizer names the outputs <rid>_<i>
        calls = [
            tokenizer_pb2.GenerateRequest(rid=base_rid, prompts=prompts, sampling_params=_sampling(one_sp), **common)
        ]
        offsets = [0]
    else:  # per-prompt sampling params or ids: one call per prompt
        calls = [
            tokenizer_pb2.GenerateRequest(
                rid=rids[i] if rids else f"{base_rid}_{i}",
                prompts=[p],
                sampling_params=_sampling(sps[i] if sps else one_sp),
                **common,
            )
            for i, p in enumerate(prompts)
        ]
        offsets = [i * n for i in range(len(prompts))]
    key = body.session_params.id if body.session_params else None
    with_index = batch or n > 1
    try:
        if not body.stream:
            outputs = await cancel_on_disconnect(request, _collect(st, calls, key, offsets))
            results = [native_output(outputs[i], body, with_index) for i in sorted(outputs)]
            return JSONResponse(results if with_index else results[0])
        streams = await cancel_on_disconnect(request, _open_all(st, calls, key))
    except ClientDisconnected:
        return Response(status_code=499)
    for s in streams:
        abort = first_abort(s.first)
        if abort is not None and not abort.is_cancelled:
            for other in streams:
                other.cancel()
            raise abort_error(abort)

    def cancel_all() -> None:
        for s in streams:
            s.cancel()

    return sse_response(_stream_events(streams, offsets, body, with_index), on_close=cancel_all)


async def _collect(
    st: GatewayState, calls: list[tokenizer_pb2.GenerateRequest], key: str | None, offsets: list[int]
) -> dict[int, Output]:
    outputs: dict[int, Output] = {}
    merged = _merged(await _open_all(st, calls, key), offsets)
    try:
        async for response in merged:
            out = outputs.setdefault(response.index, Output(response.index))
            out.add(response)
            if out.abort is not None and not out.abort.is_cancelled:  # a user abort returns its output
                raise abort_error(out.abort)
    finally:
        await merged.aclose()
    return outputs


async def _stream_events(
    streams: list[GenerateStream], offsets: list[int], body: GenerateReqInput, with_index: bool
) -> AsyncIterator[str]:
    outputs: dict[int, Output] = {}
    merged = _merged(streams, offsets)
    try:
        async for response in merged:
            out = outputs.setdefault(response.index, Output(response.index))
            out.add(response)
            yield sse(native_output(out, body, with_index))
    except ServiceError as e:
        yield sse({"error": {"message": e.message, "code": e.http_status}})
    finally:
        await merged.aclose()
    yield SSE_DONE


# ---------------------------------------------------------------------------- /encode


@route("/encode", ["POST", "PUT"])
async def encode(body: EmbeddingReqInput, request: Request) -> Response:
    st = get_state(request)
    prompts, batch = _prompts(body.text, body.input_ids)
    rid = body.rid or uuid.uuid4().hex
    request_id_var.set(rid)
    ereq = tokenizer_pb2.EmbedRequest(rid=rid, prompts=prompts, trace=trace_context())
    try:
        reply = await cancel_on_disconnect(request, st.pool.embed(ereq, timeout=st.config.request_timeout_s))
    except ClientDisconnected:
        return Response(status_code=499)
    results = [
        {
            "embedding": list(r.embedding),
            "meta_info": {"id": f"{rid}_{r.index}" if batch else rid, "prompt_tokens": r.prompt_tokens},
        }
        for r in sorted(reply.results, key=lambda r: r.index)
    ]
    return JSONResponse(results if batch else results[0])


# ---------------------------------------------------------------------------- health and info


@router.get("/health")
async def health(request: Request) -> Response:
    """200 if a tokenizer replica answers its gRPC health check with SERVING, else 503."""
    if await get_state(request).pool.any_healthy():
        return Response(status_code=200)
    return error_response(503, "no tokenizer replica is serving")


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 as soon as a 1-token generate (an embed for embedding models) answers, else 503."""
    st = get_state(request)
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
    prompt = tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=[0]))

    async def probe() -> None:
        info = await st.model_info()
        if info.is_generation:
            greq = tokenizer_pb2.GenerateRequest(
                rid=rid,
                prompts=[prompt],
                stream=True,
                trace=trace_context(),
                sampling_params=common_pb2.SamplingParams(max_new_tokens=1, temperature=0.0),
            )
            (await st.pool.generate(greq, timeout=HEALTH_CHECK_TIMEOUT_S)).cancel()  # any output will do
        else:
            await st.pool.embed(tokenizer_pb2.EmbedRequest(rid=rid, prompts=[prompt]), timeout=HEALTH_CHECK_TIMEOUT_S)

    try:
        await within(probe(), HEALTH_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(503, f"health check generate did not answer within {HEALTH_CHECK_TIMEOUT_S:.0f}s")
    except ServiceError as e:
        return error_response(503, f"health check generate failed: {e.message}")
    return Response(status_code=200)


# ---------------------------------------------------------------------------- control


@route("/flush_cache", ["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    st = get_state(request)
    reply = await st.pool.flush_cache(timeout=st.control_timeout_s)
    if not reply.success:
        return error_response(400, reply.message or "cache not flushed: requests are running")
    return JSONResponse({"success": True, "message": reply.message or "Cache flushed."})


@router.post("/abort_request")
async def abort_request(body: AbortReq, request: Request) -> Response:
    """Abort by rid (also `<rid>_<i>`) or everything, on every tokenizer replica (any may hold it)."""
    if not body.rid and not body.abort_all:
        raise bad_request("give a rid or abort_all=true", "rid")
    st = get_state(request)
    replies = await st.pool.abort_everywhere(
        tokenizer_pb2.AbortRequest(rid=body.rid, abort_all=body.abort_all), timeout=st.control_timeout_s
    )
    errors = [r for r in replies if isinstance(r, ServiceError)]
    if replies and len(errors) == len(replies):
        raise APIError.from_service_error(errors[0])
    return Response(status_code=200)


@route("/open_session", ["POST", "GET"])
async def open_session(request: Request, body: OpenSessionReq | None = None) -> Response:
    st = get_state(request)
    body = body or OpenSessionReq()
    session_id = body.session_id or uuid.uuid4().hex  # chosen here so all its requests pin to one tokenizer
    reply = await st.pool.open_session(
        tokenizer_pb2.OpenSessionRequest(capacity_of_str_len=body.capacity_of_str_len, session_id=session_id),
        timeout=st.control_timeout_s,
    )
    return JSONResponse(reply.session_id or session_id)


@route("/close_session", ["POST", "GET"])
async def close_session(body: CloseSessionReq, request: Request) -> Response:
    st = get_state(request)
    await st.pool.close_session(
        tokenizer_pb2.CloseSessionRequest(session_id=body.session_id), timeout=st.control_timeout_s
    )
    return Response(status_code=200)
