"""The size limits of every public gRPC message (meshlm.common.input_limits), checked before any
work: before a prompt is tokenized, a chat template rendered or a request fanned out.

The wire already bounds each integer to its proto type (int32, int64); these checks bound what
the wire does not: how many prompts, messages, token ids and logprob ids one request carries and
how long its strings are (a 60 MiB message could otherwise hold millions of prompts). The sampling
parameters' own limits (n, stop, logit_bias, ...) are meshlm.common.sampling_rules', checked with
the rest of the sampling rules. Every violation raises InvalidRequest naming the field.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshlm.common.input_limits import (
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_TOKEN_IDS_LOGPROB,
    MAX_TOP_LOGPROBS_NUM,
    InvalidArgument,
    check_at_most,
    check_chars,
    check_count,
)
from meshlm.v1 import common_pb2, tokenizer_pb2

TRACE_MAX_CHARS = 1024  # W3C: a traceparent is 55 characters, a tracestate at most 512


class InvalidRequest(InvalidArgument):
    """Bad input to the tokenizer's API: INVALID_ARGUMENT / HTTP 400."""


@contextlib.contextmanager
def as_invalid_request() -> Iterator[None]:
    """Re-raise a shared rule's InvalidArgument (meshlm.common) as InvalidRequest."""
    try:
        yield
    except InvalidRequest:
        raise
    except InvalidArgument as e:
        raise InvalidRequest(str(e)) from None


def check_prompt(prompt: tokenizer_pb2.Prompt, where: str) -> None:
    """One prompt's text, token ids or chat messages within their limits."""
    with as_invalid_request():
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            check_chars(f"{where}.text", prompt.text, MAX_PROMPT_CHARS)
        elif kind == "input_ids":
            check_count(f"{where}.input_ids", prompt.input_ids.ids, MAX_PROMPT_TOKENS)
        elif kind == "messages":
            chat = prompt.messages
            check_count(f"{where}.messages", chat.messages, MAX_MESSAGES)
            for i, m in enumerate(chat.messages):
                at = f"{where}.messages[{i}]"
                check_chars(f"{at}.role", m.role, MAX_NAME_CHARS)
                check_chars(f"{at}.content", m.content, MAX_PROMPT_CHARS)
                check_chars(f"{at}.name", m.name, MAX_NAME_CHARS)
                check_chars(f"{at}.tool_call_id", m.tool_call_id, MAX_ID_CHARS)
                check_chars(f"{at}.reasoning_content", m.reasoning_content, MAX_PROMPT_CHARS)
                check_count(f"{at}.tool_calls", m.tool_calls, MAX_MESSAGES)
                for j, call in enumerate(m.tool_calls):
                    check_chars(f"{at}.tool_calls[{j}].id", call.id, MAX_ID_CHARS)
                    check_chars(f"{at}.tool_calls[{j}].name", call.name, MAX_NAME_CHARS)
                    check_chars(f"{at}.tool_calls[{j}].arguments", call.arguments, MAX_PROMPT_CHARS)
            check_chars(f"{where}.tools_json", chat.tools_json, MAX_PROMPT_CHARS)
            check_chars(f"{where}.chat_template_kwargs_json", chat.chat_template_kwargs_json, MAX_PROMPT_CHARS)


def _check_trace(trace: common_pb2.TraceContext) -> None:
    check_chars("trace.traceparent", trace.traceparent, TRACE_MAX_CHARS)
    check_chars("trace.tracestate", trace.tracestate, TRACE_MAX_CHARS)


def check_generate(request: tokenizer_pb2.GenerateRequest) -> None:
    """A GenerateRequest's sizes (its prompts are checked one by one, before each is tokenized)."""
    with as_invalid_request():
        check_chars("rid", request.rid, MAX_ID_CHARS)
        check_count("prompts", request.prompts, MAX_PROMPTS)
        check_at_most("top_logprobs_num", request.top_logprobs_num, MAX_TOP_LOGPROBS_NUM)
        check_count("token_ids_logprob", request.token_ids_logprob, MAX_TOKEN_IDS_LOGPROB)
        check_chars("session_id", request.session_id, MAX_ID_CHARS)
        check_chars("session_rid", request.session_rid, MAX_ID_CHARS)
        _check_trace(request.trace)


def check_embed(request: tokenizer_pb2.EmbedRequest) -> None:
    with as_invalid_request():
        check_chars("rid", request.rid, MAX_ID_CHARS)
        check_count("prompts", request.prompts, MAX_PROMPTS)
        _check_trace(request.trace)


def check_detokenize(request: tokenizer_pb2.DetokenizeRequest) -> None:
    with as_invalid_request():
        check_count("tokens", request.tokens, MAX_PROMPT_TOKENS)


def check_id(field: str, value: str) -> None:
    """A request id or session id (Abort, OpenSession, CloseSession)."""
    with as_invalid_request():
        check_chars(field, value, MAX_ID_CHARS)
