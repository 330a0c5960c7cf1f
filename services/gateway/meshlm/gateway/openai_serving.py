"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
/v1/tokenize, /v1/detokenize. Each generate request is one TokenizerService.Generate call (n, batches
of prompts and chat templating are the tokenizer's job); outputs come back per index."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from meshlm.common.errors import ServiceError
from meshlm.common.log import request_id_var
from meshlm.gateway.errors import bad_request
from meshlm.gateway.grpc_client import ClientDisconnected, cancel_on_disconnect, trace_context
from meshlm.gateway.json_body import StrictJsonRoute
from meshlm.gateway.openai_chat import ChatPlan, ChoiceParts, plan_chat
from meshlm.gateway.openai_fields import report_unsupported
from meshlm.gateway.openai_outputs import (
    ChatChunks,
    CompletionChunks,
    base64_floats,
    chat_logprobs_of,
    completion_logprobs_of,
    logprob_delta,
    usage_of,
)
from meshlm.gateway.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
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
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    now,
)
from meshlm.gateway.openai_requests import build_sampling, chat_prompt, echo_texts, prompts_of
from meshlm.gateway.openai_streams import (
    choices_sse_response,
    disconnected,
    json_response,
    open_sse_stream,
    run_generate,
)
from meshlm.gateway.outputs import Output, sse
from meshlm.gateway.state import GatewayState, get_state
from meshlm.v1 import tokenizer_pb2

router = APIRouter(tags=["OpenAI-compatible"], route_class=StrictJsonRoute)

# ---------------------------------------------------------------------------- completions


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
    report_unsupported(body, st.config.strict_api, rid)
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
                logprob_delta(out), bool(body.logprobs), len(echo) if body.echo else None, len(echo)
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
    chunks = CompletionChunks(greq.rid, created, model)

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
        if logprobs is None and (prefix or response.text or out.finished):
            yield chunks.event(index, prefix + response.text, out.openai_finish_reason(), out.matched_stop())
        elif prefix or response.text or out.finished or (logprobs and logprobs.tokens):
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

    return choices_sse_response(stream, on_response, on_done)


# ---------------------------------------------------------------------------- chat


@router.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    st = get_state(request)
    model = await st.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    rid = body.rid or uuid.uuid4().hex
    request_id_var.set(rid)
    report_unsupported(body, st.config.strict_api, rid)
    plan = plan_chat(body, st.config)
    greq = tokenizer_pb2.GenerateRequest(
        rid=rid,
        prompts=[chat_prompt(body)],
        sampling_params=build_sampling(body, body.max_new_tokens, plan.tool_schema),
        return_logprob=body.logprobs,
        top_logprobs_num=body.top_logprobs or 0,
        return_text_in_logprobs=body.logprobs,
        stream=body.stream,
        trace=trace_context(),
    )
    if body.stream:
        return await _stream_chat(request, st, greq, body, model, plan)
    try:
        outputs = await run_generate(request, st, greq)
    except ClientDisconnected:
        return disconnected()
    choices = []
    for index, out in sorted(outputs.items()):
        parts = plan.new_choice()
        parts.feed(out.text)
        parts.finish()
        choices.append(
            ChatChoice(
                index=index,
                message=parts.message(),
                logprobs=chat_logprobs_of(logprob_delta(out), body.top_logprobs or 0) if body.logprobs else None,
                finish_reason=_chat_finish(out, parts),
                matched_stop=out.matched_stop(),
            )
        )
    return json_response(ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outputs, body.n)))


def _chat_finish(out: Output, parts: ChoiceParts) -> Literal["stop", "length", "tool_calls"] | None:
    """OpenAI's finish reason of a chat choice: tool_calls when it stopped having made calls."""
    reason = out.openai_finish_reason()
    return "tool_calls" if reason == "stop" and parts.has_calls else reason


async def _stream_chat(
    request: Request,
    st: GatewayState,
    greq: tokenizer_pb2.GenerateRequest,
    body: ChatCompletionRequest,
    model: str,
    plan: ChatPlan,
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

    parts: dict[int, ChoiceParts] = {}
    chunks = ChatChunks(greq.rid, created, model)

    def on_response(out: Output, response: tokenizer_pb2.GenerateResponse, first: bool) -> Iterable[str]:
        index = response.index
        if first:  # the first delta of each choice carries the role
            parts[index] = plan.new_choice()
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        choice = parts[index]
        logprobs = None
        if body.logprobs and len(response.meta_info.logprobs.output_token_logprobs):
            logprobs = chat_logprobs_of(response.meta_info.logprobs, body.top_logprobs or 0)
        delta = choice.feed(response.text) if response.text else None
        if logprobs is None and delta is not None and _plain_content(delta):
            assert delta.content is not None
            yield chunks.content_event(index, delta.content)
        elif delta is not None or logprobs:
            yield chunk(ChatStreamChoice(index=index, delta=delta or DeltaMessage(), logprobs=logprobs))
        if out.finished:
            rest = choice.finish()
            if rest is not None:
                yield chunk(ChatStreamChoice(index=index, delta=rest))
            yield chunk(
                ChatStreamChoice(
                    index=index,
                    delta=DeltaMessage(),
                    finish_reason=_chat_finish(out, choice),
                    matched_stop=out.matched_stop(),
                )
            )

    def on_done(outputs: dict[int, Output]) -> Iterable[str]:
        if include_usage:
            yield chunk(None, usage_of(outputs, body.n))

    return choices_sse_response(stream, on_response, on_done)


def _plain_content(delta: DeltaMessage) -> bool:
    """A delta of content only (what ChatChunks.content_event formats)."""
    return (
        delta.content is not None
        and delta.role is None
        and delta.reasoning_content is None
        and delta.tool_calls is None
    )


# ---------------------------------------------------------------------------- embeddings


@router.post("/v1/embeddings", response_model=None, responses={200: {"model": EmbeddingResponse}})
async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    st = get_state(request)
    model = await st.check_model(body.model)
    if body.dimensions is not None:
        raise bad_request("dimensions is not supported", "dimensions")
    ereq = tokenizer_pb2.EmbedRequest(
        rid=body.rid or uuid.uuid4().hex, prompts=prompts_of(body.input), trace=trace_context()
    )
    report_unsupported(body, st.config.strict_api, ereq.rid)
    try:
        reply = await cancel_on_disconnect(request, st.pool.embed(ereq, timeout=st.config.request_timeout_s))
    except ClientDisconnected:
        return disconnected()
    data, tokens = [], 0
    for result in sorted(reply.results, key=lambda r: r.index):
        values = list(result.embedding)
        embedding: Any = base64_floats(values) if body.encoding_format == "base64" else values
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
    report_unsupported(body, st.config.strict_api, "tokenize")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("set exactly one of prompt (text or messages) and messages", "prompt")
    if isinstance(body.prompt, str):
        prompt = tokenizer_pb2.Prompt(text=body.prompt)
    else:
        messages = body.messages if body.messages is not None else body.prompt
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        prompt = chat_prompt(body, messages)
    reply = await st.pool.tokenize(
        tokenizer_pb2.TokenizeRequest(prompt=prompt, add_special_tokens=body.add_special_tokens),
        timeout=st.control_timeout_s,
    )
    return TokenizeResponse(tokens=list(reply.tokens), count=reply.count, max_model_len=reply.max_model_len)


@router.post("/v1/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    st = get_state(request)
    await st.check_model(body.model)
    report_unsupported(body, st.config.strict_api, "detokenize")
    dreq = tokenizer_pb2.DetokenizeRequest(tokens=body.tokens)
    if body.skip_special_tokens is not None:
        dreq.skip_special_tokens = body.skip_special_tokens
    reply = await st.pool.detokenize(dreq, timeout=st.control_timeout_s)
    return DetokenizeResponse(text=reply.text)
