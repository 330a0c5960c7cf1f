"""Reading checkpoint tensors from an HF-format model directory.

Supported layouts, tried in this order:

    model.safetensors                       one file
    model.safetensors.index.json + shards   the index's "weight_map" names each tensor's shard
    pytorch_model.bin                       legacy pickle, read with torch.load(weights_only=True)

Invariants: every tensor is yielded exactly once, on the CPU, with the name the checkpoint
gives it (no prefix stripping: that is the model's job in its load_weights); files are opened
one at a time, so peak memory is one tensor (safetensors) or one file (.bin).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are made: the launcher resolves paths only
    import torch

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN_FILE = "pytorch_model.bin"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of `model_dir`, in load order; FileNotFoundError when there are none.

    For a sharded checkpoint every shard the index names must exist; shards are listed once
    each, sorted by file name, so the order does not depend on dict ordering in the index.
    """
    model_dir = Path(model_dir)
    single = model_dir / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' entries")
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(s) for s in shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return shards
    legacy = model_dir / PYTORCH_BIN_FILE
    if legacy.is_file():
        return [legacy]
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} with "
        f"its shards, or {PYTORCH_BIN_FILE}"
    )


def _count_tensors(files: list[Path]) -> int | None:
    """Total tensors across safetensors files (header reads only); None if any file is a .bin."""
    from safetensors import safe_open

    total = 0
    for path in files:
        if path.suffix != ".safetensors":
            return None
        with safe_open(str(path), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total


def _iterate_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one checkpoint file."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict: keys() is its listing
                yield name, f.get_tensor(name)
        return
    import torch

    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    yield from state.items()


def iterate_weights(model_dir: str | Path, *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `model_dir`.

    With `progress`, a tqdm bar ("Loading weights") on stderr counts tensors (or files, for a
    .bin checkpoint whose tensor count is unknown until it is unpickled); progress=False
    prints nothing.
    """
    files = weight_files(model_dir)
    if not progress:
        for path in files:
            yield from _iterate_file(path)
        return
    from tqdm.auto import tqdm

    total = _count_tensors(files)
    if total is None:
        with tqdm(total=len(files), desc="Loading weights", unit="file") as bar:
            for path in files:
                yield from _iterate_file(path)
                bar.update(1)
        return
    with tqdm(total=total, desc="Loading weights", unit="tensor") as bar:
        for path in files:
            for item in _iterate_file(path):
                yield item
                bar.update(1)


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor, *, name: str | None = None) -> None:
    """Copy `loaded` into `param` in place, casting to the parameter's dtype and device.

    Raises ValueError naming the parameter (`name`, else the parameter's `weight_name`
    attribute if a model set one) and both shapes when they differ; nothing is copied then.
    """
    if tuple(param.shape) != tuple(loaded.shape):
        label = name or getattr(param, "weight_name", None) or "<unnamed parameter>"
        raise ValueError(
            f"shape mismatch loading {label}: parameter has shape {tuple(param.shape)}, "
            f"checkpoint tensor has shape {tuple(loaded.shape)}"
        )
    import torch

    with torch.no_grad():
        param.data.copy_(loaded.to(dtype=param.dtype))
