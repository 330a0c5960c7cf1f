"""OpenAI response pieces from tokenizer outputs: usage, logprobs in the completions and the chat
shapes, base64 embeddings."""

from __future__ import annotations

import array
import base64
import sys
from typing import Any

from meshlm.gateway.openai_protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from meshlm.gateway.outputs import Output, input_logprob_values, json_compact
from meshlm.v1 import common_pb2


def _json_or_null(value: Any) -> str:
    """json_compact(value), without the encoder's call for a field that is almost always None."""
    return "null" if value is None else json_compact(value)


def _chunk_head(obj: str, rid: str, created: int, model: str) -> str:
    """A stream chunk's SSE event up to its first choice's index (what every chunk of one stream
    shares): the fields in the pydantic models' order, JSON as outputs.sse writes it."""
    return (
        f'data: {{"id":{json_compact(rid)},"object":"{obj}","created":{int(created)},'
        f'"model":{json_compact(model)},"choices":[{{"index":'
    )


class CompletionChunks:
    """The SSE events of one /v1/completions stream's chunks without logprobs, byte for byte what
    `sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
    index=..., text=..., finish_reason=..., matched_stop=...)]).model_dump(mode="json"))` gives,
    formatted around a prefix made once a stream: ~1 us an event against ~7 through pydantic,
    and a stream sends one an output token."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self._head = _chunk_head("text_completion", rid, created, model)

    def event(self, index: int, text: str, finish_reason: str | None, matched_stop: int | str | None) -> str:
        return (
            f'{self._head}{int(index)},"text":{json_compact(text)},"logprobs":null,'
            f'"finish_reason":{_json_or_null(finish_reason)},"matched_stop":{_json_or_null(matched_stop)}}}],'
            '"usage":null}\n\n'
        )


class ChatChunks:
    """The SSE events of one /v1/chat/completions stream's plain content deltas (no role,
    reasoning, tool calls or logprobs), byte for byte what `sse(ChatCompletionChunk(id=rid,
    created=created, model=model, choices=[ChatStreamChoice(index=..., delta=DeltaMessage(
    content=...))]).model_dump(mode="json"))` gives, around a prefix made once a stream (as
    CompletionChunks: ~1 us an event against ~8 through pydantic)."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self._head = _chunk_head("chat.completion.chunk", rid, created, model)

    def content_event(self, index: int, content: str) -> str:
        return (
            f'{self._head}{int(index)},"delta":{{"content":{json_compact(content)}}},"logprobs":null,'
            f'"finish_reason":null,"matched_stop":null}}],"usage":null}}\n\n'
        )


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
            assert into.top_logprobs is not None  # made a list when top logprobs are asked for
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


def logprob_delta(out: Output) -> common_pb2.LogprobDelta:
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


def base64_floats(values: list[float]) -> str:
    packed = array.array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
