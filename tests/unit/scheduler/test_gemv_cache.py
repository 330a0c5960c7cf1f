"""The GEMV block cache (kernels/gemv_cache.py): blocks recovered once are reused by a later
GemvOps on the same weight bytes, bit for bit; a stale, corrupt or truncated file is never
used (the blocks are recovered again and the file replaced); weights no quantized format holds
write nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from meshlm.scheduler.kernels.build import KernelUnavailable, load_library
from meshlm.scheduler.kernels.gemv import SOURCE, GemvOps, GemvWeight
from meshlm.scheduler.kernels.gemv_cache import GemvBlockCache


@pytest.fixture(scope="module")
def lib():
    try:
        return load_library(SOURCE)
    except KernelUnavailable as e:
        pytest.skip(f"no C compiler here: {e}")


def ops_at(lib, root: Path, source_id: str = "src") -> GemvOps:
    """A fresh GemvOps (as a new process would have) over the cache folder `root`."""
    return GemvOps(lib, GemvBlockCache(root, source_id, threads=2))


def gguf_weight(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).copy())


def same(a: GemvWeight, b: GemvWeight) -> bool:
    return a.format == b.format and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a.quants, b.quants), (a.scales, b.scales), (a.mins, b.mins))
    )


@pytest.mark.parametrize(("qtype", "fmt"), [(GGMLQuantizationType.Q4_1, "q4_1"), (GGMLQuantizationType.Q8_0, "q8_0")])
def test_blocks_round_trip_through_the_cache(lib, tmp_path: Path, qtype: GGMLQuantizationType, fmt: str) -> None:
    w = gguf_weight(qtype, 96, 4096)  # > one hashing chunk: the parallel digest path
    first = ops_at(lib, tmp_path)
    recovered = first.build(w)
    assert recovered.format == fmt and first.cache is not None and first.cache.stats.stored == 1
    assert len(list(tmp_path.glob("*.bin"))) == 1
    second = ops_at(lib, tmp_path)
    cached = second.build(w)
    assert second.cache is not None and second.cache.stats.hits == 1 and second.cache.stats.stored == 0
    assert same(cached, recovered) and torch.equal(GemvOps.dequantize(cached), w)
    x = torch.randn(3, w.shape[1])
    assert torch.allclose(second.gemv(x, cached, None), x @ w.T, rtol=1e-4, atol=1e-4)


def test_a_changed_weight_is_not_served_from_the_cache(lib, tmp_path: Path) -> None:
    w = gguf_weight(GGMLQuantizationType.Q4_1, 16, 64)
    ops_at(lib, tmp_path).build(w)
    off = w.clone()
    off[7, 9] = torch.nextafter(off[7, 9], torch.tensor(1.0))  # one value off the Q4_1 grid
    ops = ops_at(lib, tmp_path)
    assert ops.build(off).format == "f32"
    assert ops.cache is not None and ops.cache.stats.hits == 0
    again = ops_at(lib, tmp_path)  # "recovery fails" is cached too, and still right
    assert again.build(off).format == "f32" and again.cache is not None and again.cache.stats.hits == 1
    assert torch.equal(again.build(off).quants, off)


def test_other_kernels_or_formats_do_not_share_entries(lib, tmp_path: Path) -> None:
    w = gguf_weight(GGMLQuantizationType.Q8_0, 16, 64)
    ops_at(lib, tmp_path, "old-source").build(w)
    ops = ops_at(lib, tmp_path, "new-source")
    assert ops.build(w).format == "q8_0" and ops.cache is not None and ops.cache.stats.hits == 0
    assert ops.build(w, ("f32",)).format == "f32"


def _entry(root: Path) -> Path:
    (path,) = root.glob("*.bin")
    return path


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage", "other_key"])
def test_a_corrupt_or_stale_file_is_never_used(lib, tmp_path: Path, damage: str) -> None:
    w = gguf_weight(GGMLQuantizationType.Q4_1, 32, 128, seed=1)
    good = ops_at(lib, tmp_path).build(w)
    path = _entry(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-5] ^= 0x10
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "garbage":
        path.write_bytes(b"not a cache file")
    else:  # another weight's (valid) file under this weight's name
        other = tmp_path / "other"
        ops_at(lib, other).build(gguf_weight(GGMLQuantizationType.Q4_1, 32, 128, seed=2))
        path.write_bytes(_entry(other).read_bytes())
    ops = ops_at(lib, tmp_path)
    got = ops.build(w)
    assert ops.cache is not None and ops.cache.stats.hits == 0 and ops.cache.stats.stored == 1
    assert same(got, good) and torch.equal(GemvOps.dequantize(got), w)
    fresh = ops_at(lib, tmp_path)  # the file was replaced by a good one
    assert same(fresh.build(w), good) and fresh.cache is not None and fresh.cache.stats.hits == 1


def test_weights_no_format_holds_write_nothing(lib, tmp_path: Path) -> None:
    ops = ops_at(lib, tmp_path)
    assert ops.build(torch.randn(64, 96)).format == "f32"
    assert ops.build(gguf_weight(GGMLQuantizationType.Q4_1, 8, 96)[:, :80].contiguous()).format == "f32"
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_an_unwritable_cache_still_builds(lib, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    ops = ops_at(lib, blocker / "gemv")
    for seed in range(3):
        w = gguf_weight(GGMLQuantizationType.Q4_1, 8, 64, seed=seed)
        assert ops.build(w).format == "q4_1" and torch.equal(GemvOps.dequantize(ops.build(w)), w)
    assert ops.cache is not None and ops.cache.stats.stored == 0
    assert sum("cannot write the GEMV cache" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_digest_is_sha256_of_chunk_digests(tmp_path: Path) -> None:
    cache = GemvBlockCache(tmp_path, "src", threads=2)
    data = memoryview(bytes(range(256)) * 70000)  # ~17 MiB: three chunks
    chunks = [data[i : i + (8 << 20)] for i in range(0, len(data), 8 << 20)]
    inner = b"".join(hashlib.sha256(c).digest() for c in chunks)
    expected = hashlib.sha256(len(data).to_bytes(8, "little") + inner).hexdigest()
    assert cache.digest(data) == expected == GemvBlockCache(tmp_path, "src", threads=1).digest(data)
