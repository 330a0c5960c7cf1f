"""Model loading: turn a --model value into an HF directory and stream its weights.

resolve_model_path(None | "x.gguf" | "hf/dir") -> Path of an HF-format directory (config.json,
weights, tokenizer); iterate_weights(dir) -> (name, tensor) pairs for a model's load_weights.
"""

from __future__ import annotations

from pathlib import Path

from meshlm.scheduler.model_loader.gguf import (
    convert_gguf_to_hf,
    default_cache_root,
    find_default_gguf,
)
from meshlm.scheduler.model_loader.weight_utils import (
    default_weight_loader,
    iterate_weights,
    weight_files,
)

__all__ = [
    "convert_gguf_to_hf",
    "default_cache_root",
    "default_weight_loader",
    "find_default_gguf",
    "iterate_weights",
    "resolve_model_path",
    "weight_files",
]


def resolve_model_path(model: str | None) -> Path:
    """The HF-format directory for a --model value.

    None -> the bundled SmolLM2-135M-Instruct GGUF, converted (cached); a path to a .gguf file
    -> its conversion (cached); a directory holding config.json -> that directory. Anything
    else raises ValueError naming the value and the accepted forms.
    """
    if model is None:
        return convert_gguf_to_hf(find_default_gguf())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_to_hf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        problem = "is a directory without config.json"
    elif path.exists():
        problem = "is a file but not a .gguf file"
    else:
        problem = "does not exist"
    raise ValueError(
        f"--model {model!r} {problem}; expected an HF model directory containing config.json "
        f"or a .gguf file (omit --model to use the bundled SmolLM2-135M-Instruct)"
    )
