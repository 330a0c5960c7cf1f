"""A tools- and thinking-aware chat template (Qwen2.5 / Qwen3 style) over SmolLM2's tokenizer, for
the tests of tool calling, reasoning and template variables: SmolLM2's own template renders
neither tools nor tool calls. `tools_tokenizer_dir` copies the default model's tokenizer files
into a directory and sets this template, so a tokenizer service (or HFTokenizer) started on it
really hands `tools`, the history's tool calls, `name`, `reasoning_effort` and
chat_template_kwargs such as `enable_thinking` to a template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE = (
    "{%- set sys = messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' %}"
    "{{- '<|im_start|>system\\n' + sys }}"
    "{%- if reasoning_effort is defined %}{{- '\\nReasoning effort: ' + reasoning_effort }}{%- endif %}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nFor each call, reply with <tool_call>\\n{"name": <name>, "arguments": <args>}'
    "\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response id=' + (message.tool_call_id or '') + '>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \''
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + ((' name=' + message.name) if message.name else '') + '\\n'"
    " + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def tools_tokenizer_dir(model_dir: str | Path, into: str | Path) -> Path:
    """`into` holding the model's tokenizer files with TEMPLATE as the chat template."""
    src, dst = Path(model_dir), Path(into)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst
