"""An HF tokenizer directory without transformers (and so without torch).

Tokenization uses the `tokenizers` library on tokenizer.json; chat templates are rendered with
jinja2 exactly as transformers' `apply_chat_template` does (sandboxed environment with
trim_blocks/lstrip_blocks and loopcontrols, the `tojson` override, `raise_exception`,
`strftime_now`, the special tokens of tokenizer_config.json as variables), and the rendered text
is tokenized without adding special tokens (the template already holds them).

Template source, as transformers: `chat_template.jinja` if present, else tokenizer_config.json's
`chat_template` (a string, or a list of {name, template} of which "default" is used).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshlm.common.tokenizer_files import clean_up_tokenization, open_tokenizer_json, read_json_object, token_content

# Special-token attributes transformers exposes to chat templates (special_tokens_map).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed to render."""


def _compile(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        # for serving it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json + chat template of one HF directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tok = open_tokenizer_json(self.path)
        self.config: dict[str, Any] = read_json_object(self.path / "tokenizer_config.json")
        # Legacy special_tokens_map.json fills what tokenizer_config.json does not set (as HF).
        legacy = read_json_object(self.path / "special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = token_content(self.config.get(key))
            if value is None:
                value = token_content(legacy.get(key))
            if value is not None:
                self.special_tokens[key] = value
        self.chat_template: str | None = self._load_template()
        self._compiled: jinja2.Template | None = None
        self.clean_up_tokenization_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        # Ids the tokenizer knows (base vocab + added tokens).
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        mml = self.config.get("model_max_length")
        self.model_max_length = int(mml) if isinstance(mml, (int, float)) and 0 < mml < 1e9 else 0
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def _load_template(self) -> str | None:
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        tmpl = self.config.get("chat_template")
        if isinstance(tmpl, str):
            return tmpl
        if isinstance(tmpl, list):
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            return named.get("default") or next(iter(named.values()), None)
        return None

    # ---- text <-> ids ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- chat -----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation (transformers' render, tokenize=False).

        `kwargs` are template variables (tools, documents, chat_template_kwargs). With
        continue_final_message the final message is left open, as transformers does it: the render
        is cut right after the last occurrence of that message's content (stripped, if the
        template trims it), so the prompt ends with the content and no end-of-turn tokens."""
        if self.chat_template is None:
            raise ChatTemplateError(f"the tokenizer at {str(self.path)!r} has no chat template; send text or input_ids")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        # As transformers: tools/documents are passed (None when absent), so templates that
        # test `tools is not none` behave the same.
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            rendered: str = self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on the messages: {e!r}") from e
        if continue_final_message:
            rendered = _cut_after_final(rendered, messages[-1].get("content"))
        return rendered

    def chat_ids(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """(rendered text, its ids). The template holds the special tokens: none are added."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        return text, self.encode(text, add_special_tokens=False)


def _cut_after_final(rendered: str, content: Any) -> str:
    """`rendered` up to the end of the final message's content (its last occurrence)."""
    if isinstance(content, list):  # content parts: the last text part, as transformers
        texts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with non-empty content")
    for needle in (content, content.strip()):
        at = rendered.rfind(needle)
        if at >= 0:
            return rendered[: at + len(needle)]
    raise ChatTemplateError("continue_final_message: the template does not render the final message's content")
