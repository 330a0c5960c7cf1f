"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
/v1/tokenize, /v1/detokenize. Each generate request is one TokenizerService.Generate call (n, batches
of prompts and chat templating are the tokenizer's job); outputs come back per index."""

from __future__ import annotations

import array
import asyncio
import base64
import json
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from meshlm.common.errors import ServiceError
from meshlm.common.log import request_id_var
from meshlm.gateway.errors import bad_request
from meshlm.gateway.grpc_client import (
    ClientDisconnected,
    GenerateStream,
    cancel_on_disconnect,
    sampling_params,
    trace_context,
)
from meshlm.gateway.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    now,
)
from meshlm.gateway.outputs import (
    SSE_DONE,
    Output,
    abort_error,
    first_abort,
    input_logprob_values,
    sse,
    sse_error,
    sse_response,
)
from meshlm.gateway.state import GatewayState, get_state
from meshlm.v1 import common_pb2, tokenizer_pb2

router = APIRouter(tags=["OpenAI-compatible"])
PromptValue = str | list[str] | list[int] | list[list[int]]

# ---------------------------------------------------------------------------- request building


def prompts_of(value: PromptValue) -> list[tokenizer_pb2.Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> one Prompt per prompt."""
    if isinstance(value, str):
        return [tokenizer_pb2.Prompt(text=value)]
    if isinstance(value[0], int):
        return [tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=value))]
    if isinstance(value[0], str):
        return [tokenizer_pb2.Prompt(text=v) for v in value]
    return [tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=v)) for v in value]


def build_sampling(req: Any, max_new_tokens: int | None) -> common_pb2.SamplingParams:
    if req.tools:
        raise bad_request("tools (function calling) are not supported", "tools")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    values = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=req.min_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        stop=[s for s in stop if s] or None,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        no_stop_trim=req.no_stop_trim,
        n=req.n,
        logit_bias=req.logit_bias,
        sampling_seed=req.seed,
        json_schema=req.json_schema,
        regex=req.regex,
        ebnf=req.ebnf,
    )
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            values["json_schema"] = values["json_schema"] or '{"type": "object"}'
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be an object", "response_format")
            values["json_schema"] = json.dumps(schema)
        elif kind != "text":
            raise bad_request(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format"
            )
    try:
        return sampling_params(values)
    except (ValueError, TypeError) as e:
        raise bad_request(f"invalid sampling parameters: {e}") from None


def usage_of(outputs: dict[int, Output], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample); completion tokens over all outputs."""
    firsts = [o for i, o in outputs.items() if i % n == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outputs.values())
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.cached_tokens for o in firsts)),
    )


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
    stream: GenerateStream, on_response: ChoiceEvents, on_done: Callable[[dict[int, Output]], Iterable[str]]
) -> AsyncIterator[str]:
    """The SSE body of both OpenAI streams. Each response updates its choice's Output (index ->
    Output) and yields on_response(out, response, first-of-its-choice); an abort ends the stream
    with an error event, a completed stream with on_done(outputs). A service error becomes an
    error event; the stream is always cancelled and the body always ends with [DONE]."""
    outputs: dict[int, Output] = {}
    try:
        async for response in stream:
            first = response.index not in outputs
            out = outputs.setdefault(response.index, Output(response.index))
            out.add(response)
            if out.abort is not None:
                err = abort_error(out.abort)
                yield sse_error(err.status, err.message)
                break
            for event in on_response(out, response, first):
                yield event
        else:
            for event in on_done(outputs):
                yield event
    except ServiceError as e:
        yield sse_error(e.http_status, e.message)
    finally:
        stream.cancel()
    yield SSE_DONE


def json_response(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def disconnected() -> Response:
    return Response(status_code=499)


# ---------------------------------------------------------------------------- logprobs


def completion_logprobs(
    entries: list[Any], values: list[float | None], tops: list[Any] | None, offset: int, into: CompletionLogprobs
) -> int:
    """Append tokens in OpenAI's completions shape; returns the text offset after them."""
    for i, entry in enumerate(entries):
        into.tokens.append(entry.text)
        into.token_logprobs.append(values[i])
        into.text_offset.append(offset)
        offset += len(entry.text)
        if tops is not None:
            top = tops[i] if i < len(tops) else None
            into.top_logprobs.append({t.text: t.logprob for t in top.entries} if top and top.entries else None)
    return offset


def completion_logprobs_of(
    lp: common_pb2.LogprobDelta, top: bool, echo_offset: int | None, offset: int
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of one delta (or a whole output); prompt tokens first when echoing."""
    out = CompletionLogprobs(top_logprobs=[] if top else None)
    if echo_offset is not None and len(lp.input_token_logprobs):
        entries = list(lp.input_token_logprobs)
        tops = list(lp.input_top_logprobs) if top else None
        completion_logprobs(entries, input_logprob_values(entries), tops, 0, out)
        offset = echo_offset
    entries = list(lp.output_token_logprobs)
    offset = completion_logprobs(
        entries, [e.logprob for e in entries], list(lp.output_top_logprobs) if top else None, offset, out
    )
    return out, offset


def _logprob_delta(out: Output) -> common_pb2.LogprobDelta:
    delta = common_pb2.LogprobDelta()
    for name, items in out.logprobs.items():
        getattr(delta, name).extend(items)
    return delta


def chat_logprobs_of(lp: common_pb2.LogprobDelta, top: int) -> ChatLogprobs:
    content = []
    tops = list(lp.output_top_logprobs)
    for i, e in enumerate(lp.output_token_logprobs):
        alternatives = tops[i].entries if top and i < len(tops) else []
        content.append(
            ChatLogprobToken(
                token=e.text,
                logprob=e.logprob,
                bytes=list(e.text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.text.encode("utf-8")))
                    for t in alternatives
                ],
            )
        )
    return ChatLogprobs(content=content)


# ---------------------------------------------------------------------------- completions


async def _detokenize(st: GatewayState, ids: list[int]) -> str:
    reply = await st.pool.detokenize(
        tokenizer_pb2.DetokenizeRequest(tokens=ids, skip_special_tokens=False), timeout=st.control_timeout_s
    )
    return reply.text


async def echo_texts(st: GatewayState, prompt: PromptValue) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    if isinstance(prompt[0], int):
        return [await _detokenize(st, prompt)]
    return list(await asyncio.gather(*(_detokenize(st, ids) for ids in prompt)))


@router.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    st = get_state(request)
    model = await st.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    rid = body.rid or uuid.uuid4().hex
    request_id_var.set(rid)
    want_lp = body.logprobs is not None
    greq = tokenizer_pb2.GenerateRequest(
        rid=rid,
        prompts=prompts_of(body.prompt),
        sampling_params=build_sampling(body, body.max_tokens),
        return_logprob=want_lp,
        top_logprobs_num=body.logprobs or 0,
        return_text_in_logprobs=want_lp,
        stream=body.stream,
        trace=trace_context(),
    )
    if body.echo and want_lp:
        greq.logprob_start_len = 0
    echoes = await echo_texts(st, body.prompt) if body.echo else None
    if body.stream:
        return await _stream_completion(request, st, greq, body, model, echoes)
    try:
        outputs = await run_generate(request, st, greq)
    except ClientDisconnected:
        return disconnected()
    choices = []
    for index in sorted(outputs):
        out = outputs[index]
        echo = echoes[index // body.n] if echoes else ""
        logprobs = None
        if want_lp:
            logprobs, _ = completion_logprobs_of(
                _logprob_delta(out), bool(body.logprobs), len(echo) if body.echo else None, len(echo)
            )
        choices.append(
            CompletionChoice(
                index=index,
                text=echo + out.text,
                logprobs=logprobs,
                finish_reason=out.openai_finish_reason(),
                matched_stop=out.matched_stop(),
            )
        )
    return json_response(CompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outputs, body.n)))


async def _stream_completion(
    request: Request,
    st: GatewayState,
    greq: tokenizer_pb2.GenerateRequest,
    body: CompletionRequest,
    model: str,
    echoes: list[str] | None,
) -> Response:
    stream = await open_sse_stream(request, st, greq)
    if isinstance(stream, Response):
        return stream
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = now()
    offsets: dict[int, int] = {}  # choice index -> text offset of its next logprob

    def on_response(out: Output, response: tokenizer_pb2.GenerateResponse, first: bool) -> Iterable[str]:
        index = response.index
        prefix = echoes[index // body.n] if first and echoes else ""
        if first:
            offsets[index] = len(prefix)
        logprobs = None
        if greq.return_logprob:
            logprobs, offsets[index] = completion_logprobs_of(
                response.meta_info.logprobs,
                bool(body.logprobs),
                len(prefix) if body.echo else None,
                offsets[index],
            )
        if prefix or response.text or out.finished or (logprobs and logprobs.tokens):
            choice = CompletionChoice(
                index=index,
                text=prefix + response.text,
                logprobs=logprobs,
                finish_reason=out.openai_finish_reason(),
                matched_stop=out.matched_stop(),
            )
            yield sse(
                CompletionStreamResponse(id=greq.rid, created=created, model=model, choices=[choice]).model_dump(
                    mode="json"
                )
            )

    def on_done(outputs: dict[int, Output]) -> Iterable[str]:
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    id=greq.rid, created=created, model=model, choices=[], usage=usage_of(outputs, body.n)
                ).model_dump(mode="json")
            )

    return sse_response(choice_events(stream, on_response, on_done), on_close=stream.cancel)


# ---------------------------------------------------------------------------- chat


def chat_prompt(body: ChatCompletionRequest) -> tokenizer_pb2.Prompt:
    messages = []
    for i, m in enumerate(body.messages):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported, got {part.type!r}", "messages"
                    )
                parts.append(part.text)
            content = "".join(parts)
        role = "system" if m.role == "developer" else m.role
        messages.append(tokenizer_pb2.ChatMessage(role=role, content=content))
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
    return tokenizer_pb2.Prompt(
        messages=tokenizer_pb2.ChatMessages(messages=messages, add_generation_prompt=not body.continue_final_message)
    )


@router.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    st = get_state(request)
    model = await st.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    rid = body.rid or uuid.uuid4().hex
    request_id_var.set(rid)
    greq = tokenizer_pb2.GenerateRequest(
        rid=rid,
        prompts=[chat_prompt(body)],
        sampling_params=build_sampling(body, body.max_new_tokens),
        return_logprob=body.logprobs,
        top_logprobs_num=body.top_logprobs or 0,
        return_text_in_logprobs=body.logprobs,
        stream=body.stream,
        trace=trace_context(),
    )
    if body.stream:
        return await _stream_chat(request, st, greq, body, model)
    try:
        outputs = await run_generate(request, st, greq)
    except ClientDisconnected:
        return disconnected()
    choices = [
        ChatChoice(
            index=index,
            message=ChatMessageOut(content=out.text),
            logprobs=chat_logprobs_of(_logprob_delta(out), body.top_logprobs or 0) if body.logprobs else None,
            finish_reason=out.openai_finish_reason(),
            matched_stop=out.matched_stop(),
        )
        for index, out in sorted(outputs.items())
    ]
    return json_response(ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outputs, body.n)))


async def _stream_chat(
    request: Request, st: GatewayState, greq: tokenizer_pb2.GenerateRequest, body: ChatCompletionRequest, model: str
) -> Response:
    stream = await open_sse_stream(request, st, greq)
    if isinstance(stream, Response):
        return stream
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = now()

    def chunk(choice: ChatStreamChoice | None, usage: UsageInfo | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=greq.rid, created=created, model=model, choices=[choice] if choice else [], usage=usage
            ).model_dump(mode="json")
        )

    def on_response(out: Output, response: tokenizer_pb2.GenerateResponse, first: bool) -> Iterable[str]:
        index = response.index
        if first:  # the first delta of each choice carries the role
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        logprobs = None
        if body.logprobs and len(response.meta_info.logprobs.output_token_logprobs):
            logprobs = chat_logprobs_of(response.meta_info.logprobs, body.top_logprobs or 0)
        if response.text or logprobs:
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=response.text), logprobs=logprobs))
        if out.finished:
            yield chunk(
                ChatStreamChoice(
                    index=index,
                    delta=DeltaMessage(),
                    finish_reason=out.openai_finish_reason(),
                    matched_stop=out.matched_stop(),
                )
            )

    def on_done(outputs: dict[int, Output]) -> Iterable[str]:
        if include_usage:
            yield chunk(None, usage_of(outputs, body.n))

    return sse_response(choice_events(stream, on_response, on_done), on_close=stream.cancel)


# ---------------------------------------------------------------------------- embeddings


def _base64_floats(values: list[float]) -> str:
    packed = array.array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


@router.post("/v1/embeddings", response_model=None, responses={200: {"model": EmbeddingResponse}})
async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    st = get_state(request)
    model = await st.check_model(body.model)
    if body.dimensions is not None:
        raise bad_request("dimensions is not supported", "dimensions")
    ereq = tokenizer_pb2.EmbedRequest(
        rid=body.rid or uuid.uuid4().hex, prompts=prompts_of(body.input), trace=trace_context()
    )
    try:
        reply = await cancel_on_disconnect(request, st.pool.embed(ereq, timeout=st.config.request_timeout_s))
    except ClientDisconnected:
        return disconnected()
    data, tokens = [], 0
    for result in sorted(reply.results, key=lambda r: r.index):
        values = list(result.embedding)
        embedding: Any = _base64_floats(values) if body.encoding_format == "base64" else values
        data.append(EmbeddingData(index=result.index, embedding=embedding))
        tokens += result.prompt_tokens
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return json_response(EmbeddingResponse(data=data, model=model, usage=usage))


# ---------------------------------------------------------------------------- models, tokenize


async def _model_card(st: GatewayState) -> ModelCard:
    name = await st.served_model_name()
    info = st.cached_model_info()
    if info is None:
        try:
            info = await st.model_info(timeout=2.0)
        except ServiceError:
            info = None  # a configured name works without a tokenizer; the details are best effort
    return ModelCard(
        id=name,
        created=st.started,
        root=(info.model_path or None) if info else None,
        max_model_len=(info.context_length or None) if info else None,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[await _model_card(get_state(request))])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    st = get_state(request)
    await st.check_model(model_id)
    return await _model_card(st)


@router.post("/v1/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    st = get_state(request)
    await st.check_model(body.model)
    if isinstance(body.prompt, str):
        prompt = tokenizer_pb2.Prompt(text=body.prompt)
    else:
        msgs = [
            tokenizer_pb2.ChatMessage(role=m.role, content=m.content if isinstance(m.content, str) else "")
            for m in body.prompt
        ]
        prompt = tokenizer_pb2.Prompt(messages=tokenizer_pb2.ChatMessages(messages=msgs))
    reply = await st.pool.tokenize(
        tokenizer_pb2.TokenizeRequest(prompt=prompt, add_special_tokens=body.add_special_tokens),
        timeout=st.control_timeout_s,
    )
    return TokenizeResponse(tokens=list(reply.tokens), count=reply.count, max_model_len=reply.max_model_len)


@router.post("/v1/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    st = get_state(request)
    await st.check_model(body.model)
    dreq = tokenizer_pb2.DetokenizeRequest(tokens=body.tokens)
    if body.skip_special_tokens is not None:
        dreq.skip_special_tokens = body.skip_special_tokens
    reply = await st.pool.detokenize(dreq, timeout=st.control_timeout_s)
    return DetokenizeResponse(text=reply.text)
