"""The scheduler's start-up reads its model facts without transformers (runtime.load_model_facts):
ModelConfig from config.json with plain json gives what transformers' AutoConfig reads, the
FastTokenizer (model_loader/tokenizer.py) encodes and decodes as transformers' tokenizer does,
and a scheduler start-up in a fresh process never imports transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_loader.tokenizer import FastTokenizer, hf_tokenizer, load_tokenizer
from meshlm.scheduler.models.bert import find_minilm_path

TEXTS = (
    "a",
    "Hello , world . I 'm here , aren't you ?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "émoji 🎉 and ünïcode",
    "",
)


def _hf_facts(path: Path) -> dict:
    """What the old start-up (transformers' AutoConfig) reads for the fields ModelConfig has."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path))
    rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    heads = cfg.num_attention_heads
    return {
        "architecture": cfg.architectures[0],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "context_len": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(rope),
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _tiny_config(kind: str, out: Path) -> Path:
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    shape.update(num_hidden_layers=2, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False)
    cls = Qwen2Config if kind == "qwen2" else LlamaConfig
    config = cls(**shape, architectures=["Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"])
    config.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("model", ["smollm2", "llama", "qwen2"])
def test_model_config_equals_what_transformers_reads(model: str, smollm_path: str, tmp_path: Path) -> None:
    path = Path(smollm_path) if model == "smollm2" else _tiny_config(model, tmp_path)
    mc = ModelConfig.from_path(path)
    ours = {k: getattr(mc, k) for k in _hf_facts(path)}
    assert ours == _hf_facts(path)
    assert mc.attention_bias == (model == "qwen2")  # Qwen2's q/k/v have biases, Llama's not


def test_model_config_errors_name_the_missing_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(KeyError, match="num_hidden_layers"):
        ModelConfig.from_path(tmp_path)


def _compare(path: Path) -> None:
    from transformers import AutoTokenizer

    fast, hf = FastTokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert fast.bos_token_id == hf.bos_token_id
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
        assert fast(text).input_ids == list(hf(text).input_ids), text
        ids = hf.encode(text)
        assert fast.decode(ids) == hf.decode(ids), text
        assert fast.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text


def test_fast_tokenizer_equals_transformers_on_the_default_model(smollm_path: str) -> None:
    _compare(Path(smollm_path))


def test_fast_tokenizer_equals_transformers_on_bert() -> None:
    _compare(find_minilm_path())  # [CLS]/[SEP] added by the post-processor, no BOS


@pytest.mark.parametrize("model", ["smollm2", "bert"])
@pytest.mark.parametrize("force_bpe", [False, True])
def test_fast_tokenizer_cleans_up_spaces_as_transformers(
    model: str, force_bpe: bool, smollm_path: str, tmp_path: Path
) -> None:
    """clean_up_tokenization_spaces: applied to WordPiece (BERT), skipped for a BPE vocabulary
    (SmolLM2) unless the config forces it, as transformers does."""
    source = Path(smollm_path) if model == "smollm2" else find_minilm_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True
    if force_bpe:
        cfg["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert FastTokenizer(tmp_path).clean_up_tokenization_spaces == (model == "bert" or force_bpe)
    _compare(tmp_path)


def test_hf_tokenizer_is_loaded_once_and_only_on_demand(smollm_path: str) -> None:
    tok = load_tokenizer(smollm_path)
    assert isinstance(tok, FastTokenizer) and tok._hf is None
    hf = hf_tokenizer(tok)
    assert hf is hf_tokenizer(tok) and hf.chat_template
    assert hf_tokenizer(hf) is hf


STARTUP = textwrap.dedent(
    """
    import sys
    from meshlm.scheduler.config import SchedulerConfig
    from meshlm.scheduler.model_loader import resolve_model_path
    from meshlm.scheduler.runtime import SchedulerRuntime
    import meshlm.scheduler.service.server  # the service's own imports

    resolve_model_path(None)  # the default model's cached conversion
    config = SchedulerConfig(model_path=sys.argv[1], max_total_tokens=256, load_progress=False)
    runtime = SchedulerRuntime(config, lambda m: None, lambda m: None)
    assert runtime.scheduler.max_total_num_tokens == 256
    loaded = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
    print("TRANSFORMERS", len(loaded), loaded[:5])
    """
)


def test_scheduler_start_up_does_not_import_transformers(smollm_path: str, tmp_path: Path) -> None:
    """A tiny random Llama with SmolLM2's tokenizer: the whole SchedulerRuntime (model facts,
    weights, prepack, KV pool) in a fresh interpreter, then a look at sys.modules."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    LlamaForCausalLM(LlamaConfig(**shape, num_hidden_layers=2, vocab_size=49152)).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(smollm_path).save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", STARTUP, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRANSFORMERS 0 []" in proc.stdout, proc.stdout
