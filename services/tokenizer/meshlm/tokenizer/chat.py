"""Chat messages of the public API (tokenizer.proto `ChatMessages`) as the variables of a chat
template, the way transformers' apply_chat_template and vLLM pass them:

- each message is a dict with `role` and `content`, plus `name`, `tool_calls` and `tool_call_id`,
  `reasoning_content` when set (templates test `message.tool_calls is defined`, so unset fields
  are absent, never None);
- a tool call is `{"id", "type": "function", "function": {"name", "arguments"}}` whose
  `arguments` is the parsed JSON object when it parses to one (templates render it with
  `tojson`, as vLLM hands them), else the text as sent;
- `tools` is the JSON list of tools (None when absent); `chat_template_kwargs` are further
  variables, which may not replace the ones the renderer sets (messages, tools, the flags).

Every problem is an `InvalidRequest` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from meshlm.common.sampling_rules import InvalidArgument
from meshlm.v1 import tokenizer_pb2

# Variables the renderer owns; chat_template_kwargs may not set them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


class ChatInputError(InvalidArgument):
    """A chat message or template variable that cannot be rendered (INVALID_ARGUMENT)."""


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def message_dict(m: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.HasField("name"):
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type or "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.HasField("tool_call_id"):
        out["tool_call_id"] = m.tool_call_id
    if m.HasField("reasoning_content"):
        out["reasoning_content"] = m.reasoning_content
    return out


def _json_field(text: str, field: str, kind: type, what: str) -> Any:
    """`text` parsed as JSON of type `kind`; ChatInputError naming `field` otherwise."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ChatInputError(f"{field} is not JSON: {e}") from None
    if not isinstance(value, kind):
        raise ChatInputError(f"{field} must be {what}")
    return value


def template_variables(msgs: tokenizer_pb2.ChatMessages, where: str) -> dict[str, Any]:
    """tools + chat_template_kwargs of `msgs` as template variables."""
    variables: dict[str, Any] = {}
    if msgs.chat_template_kwargs_json:
        kwargs = _json_field(
            msgs.chat_template_kwargs_json, f"{where}.chat_template_kwargs_json", dict, "a JSON object"
        )
        clash = sorted(RESERVED_VARIABLES & kwargs.keys())
        if clash:
            raise ChatInputError(f"{where}.chat_template_kwargs may not set {', '.join(clash)}")
        variables.update(kwargs)
    if msgs.tools_json:
        variables["tools"] = _json_field(msgs.tools_json, f"{where}.tools_json", list, "a JSON list of tools")
    return variables
