"""OpenAI request bodies as tokenizer calls: prompts (text, ids, batches, chat messages), sampling
parameters (with response_format), and the prompt texts an echo repeats."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from meshlm.gateway.errors import bad_request
from meshlm.gateway.grpc_client import sampling_params
from meshlm.gateway.openai_protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from meshlm.gateway.state import GatewayState
from meshlm.v1 import common_pb2, tokenizer_pb2

PromptValue = str | list[str] | list[int] | list[list[int]]


def prompts_of(value: PromptValue) -> list[tokenizer_pb2.Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> one Prompt per prompt."""
    if isinstance(value, str):
        return [tokenizer_pb2.Prompt(text=value)]
    if isinstance(value[0], int):
        return [tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=value))]
    if isinstance(value[0], str):
        return [tokenizer_pb2.Prompt(text=v) for v in value]
    return [tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=v)) for v in value]


def build_sampling(req: Any, max_new_tokens: int | None, tool_schema: str | None = None) -> common_pb2.SamplingParams:
    """The request's sampling parameters; `tool_schema` is the constraint of a required or
    named tool_choice (openai_chat.py), which no other constraint may join."""
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
    constraint = response_format_schema(req.response_format)
    if constraint is not None:
        if values["regex"] is not None or values["ebnf"] is not None:
            raise bad_request("response_format cannot be combined with regex or ebnf", "response_format")
        values["json_schema"] = constraint  # as in SGLang, response_format wins over json_schema
    if tool_schema is not None:
        given = [k for k in ("json_schema", "regex", "ebnf") if values.get(k)]
        if given:
            raise bad_request(
                f"tool_choice required / a named function cannot be combined with {given[0]}", "tool_choice"
            )
        values["json_schema"] = tool_schema
    try:
        return sampling_params(values)
    except (ValueError, TypeError) as e:
        raise bad_request(f"invalid sampling parameters: {e}") from None


OBJECT = '{"type": "object"}'  # json_object, as SGLang maps it


def response_format_schema(fmt: dict[str, Any] | None) -> str | None:
    """OpenAI response_format as SGLang's sampling_params.json_schema: text = None, json_object
    = any JSON object, json_schema = its `schema` (`schema_` accepted too); the scheduler's
    grammar backend compiles it (an uncompilable schema is its 400)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema", "response_format")
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be an object", "response_format")
        return json.dumps(schema)
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")


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


def _content(i: int, m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{i}].content: only text parts are supported, got {part.type!r}", "messages")
        parts.append(part.text)
    return "".join(parts)


def chat_message(i: int, m: ChatMessage) -> tokenizer_pb2.ChatMessage:
    """One OpenAI message as the tokenizer's: developer is system; name, tool calls, the answered
    call's id and earlier reasoning are kept for the template."""
    out = tokenizer_pb2.ChatMessage(role="system" if m.role == "developer" else m.role, content=_content(i, m))
    if m.name is not None:
        out.name = m.name
    if m.tool_call_id is not None:
        out.tool_call_id = m.tool_call_id
    if m.reasoning_content is not None:
        out.reasoning_content = m.reasoning_content
    for call in m.tool_calls or ():
        out.tool_calls.add(id=call.id, type=call.type, name=call.function.name, arguments=call.function.arguments)
    return out


def chat_prompt(
    body: ChatCompletionRequest | TokenizeRequest, messages: list[ChatMessage] | None = None
) -> tokenizer_pb2.Prompt:
    """The request's chat as a Prompt: messages, tools, chat_template_kwargs (+ reasoning_effort as
    a template variable, as vLLM passes it), add_generation_prompt / continue_final_message."""
    msgs = messages if messages is not None else body.messages or []
    if body.continue_final_message:
        if msgs[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
        if body.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
    add_gen = body.add_generation_prompt if body.add_generation_prompt is not None else not body.continue_final_message
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    chat = tokenizer_pb2.ChatMessages(
        messages=[chat_message(i, m) for i, m in enumerate(msgs)],
        add_generation_prompt=add_gen,
        continue_final_message=body.continue_final_message,
    )
    if body.tools:
        chat.tools_json = json.dumps([t.model_dump(mode="json", exclude_none=True) for t in body.tools])
    if kwargs:
        chat.chat_template_kwargs_json = json.dumps(kwargs)
    return tokenizer_pb2.Prompt(messages=chat)
