"""GemvBlockCache: the Q4_1 / Q8_0 blocks recovered from a float32 weight, kept on disk.

Recovering the blocks of a dequantized GGUF (kernels/gemv.py) reads every weight and checks
every block bit for bit: about a second of start-up for the default model, the same result each
time. The cache keeps each weight's result in `<meshlm cache>/gemv/<key>.bin`, where the key is a
SHA-256 of the weight's bytes (hashed in parallel chunks: a fraction of the recovery's cost),
its shape, the formats asked for and the identity of the kernels' C source (a changed block
layout never reads an old file). A weight no quantized format holds is known from its first
row without hashing (kernels/gemv.py), so non-GGUF models pay nothing here.

File: MAGIC, a 4-byte little-endian header length, a JSON header (version, key, format, shape,
the byte length and SHA-256 of each tensor), then the tensors' raw bytes (scales, mins,
quants). `load` returns None, and the caller recovers again, unless every header field matches
what the caller expects and every tensor's digest matches its bytes: a truncated, corrupt or
stale file is never used (it is replaced by the next `store`). `store` writes a private
temporary file and renames it into place (atomic; concurrent writers of one key each rename a
complete file). An unwritable cache folder disables storing, never the kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"MESHLM-GEMV\n"
VERSION = 1
CHUNK_BYTES = 8 << 20  # the unit of parallel hashing
_TENSORS = ("scales", "mins", "quants")
_DTYPES = {"float32": torch.float32, "uint8": torch.uint8, "int8": torch.int8}


@dataclass(frozen=True)
class CachedBlocks:
    """What a cache file holds: the format and its tensors (None where the format has none;
    all None for "f32": recovery was tried and no quantized format holds the weight)."""

    format: str
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    quants: torch.Tensor | None = None


@dataclass
class CacheStats:
    hits: int = 0
    stored: int = 0
    recover_s: float = 0.0  # seconds spent recovering (the misses' cost)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")


class GemvBlockCache:
    def __init__(self, root: Path, source_id: str, threads: int | None = None) -> None:
        self.root = root
        self.source_id = source_id
        self._threads = max(1, threads or torch.get_num_threads())
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._unwritable = False  # set at the first failed store: warn once, stop trying
        self.stats = CacheStats()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gemv-cache-hash")
            return self._pool

    def digest(self, data: memoryview) -> str:
        """SHA-256 over the SHA-256s of CHUNK_BYTES pieces of data (hashlib drops the GIL, so
        the pieces hash on several threads)."""
        pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [data]
        if len(pieces) == 1 or self._threads == 1:
            parts = [hashlib.sha256(p).digest() for p in pieces]
        else:
            parts = list(self._executor().map(lambda p: hashlib.sha256(p).digest(), pieces))
        return hashlib.sha256(struct.pack("<Q", len(data)) + b"".join(parts)).hexdigest()

    def key(self, weight: torch.Tensor, formats: tuple[str, ...]) -> str:
        """The cache key of a float32 [N, K] contiguous weight for `formats`."""
        n, k = weight.shape
        head = f"v{VERSION}:{self.source_id}:{n}x{k}:{','.join(formats)}:"
        return hashlib.sha256(head.encode() + self.digest(_bytes_of(weight)).encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.bin"

    def load(self, key: str, n: int, k: int) -> CachedBlocks | None:
        """The blocks stored under key for an [n, k] weight, or None (absent, corrupt, stale)."""
        try:
            with open(self.path(key), "rb") as f:
                raw = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(raw) != len(raw):
                    raise OSError("short read")
        except OSError:
            return None
        try:
            return self._parse(raw, key, n, k)
        except (ValueError, KeyError, TypeError, AttributeError, struct.error, RuntimeError) as e:
            log.warning("ignoring GEMV cache file %s (%s); recovering the blocks again", self.path(key), e)
            return None

    def _parse(self, raw: bytearray, key: str, n: int, k: int) -> CachedBlocks:
        if not raw.startswith(MAGIC):
            raise ValueError("not a GEMV cache file")
        (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
        start = len(MAGIC) + 4
        header = json.loads(raw[start : start + hlen])
        if header["version"] != VERSION or header["key"] != key or header["shape"] != [n, k]:
            raise ValueError("stale: written for another weight or cache version")
        fmt = header["format"]
        expected = _expected_tensors(fmt, n, k)
        if set(header["tensors"]) != set(expected):
            raise ValueError(f"tensors {sorted(header['tensors'])} do not fit format {fmt!r}")
        offset = start + hlen
        out: dict[str, torch.Tensor] = {}
        for name in _TENSORS:
            if name not in expected:
                continue
            meta, (dtype, numel) = header["tensors"][name], expected[name]
            size = numel * torch.empty(0, dtype=_DTYPES[dtype]).element_size()
            if meta["dtype"] != dtype or meta["bytes"] != size or offset + size > len(raw):
                raise ValueError(f"{name}: wrong dtype or size")
            chunk = memoryview(raw)[offset : offset + size]
            if self.digest(chunk) != meta["sha256"]:
                raise ValueError(f"{name}: checksum mismatch")
            # The tensors share `raw` (frombuffer keeps it alive): no copy of the payload.
            out[name] = torch.frombuffer(raw, dtype=_DTYPES[dtype], count=numel, offset=offset)
            offset += size
        if offset != len(raw):
            raise ValueError("trailing bytes")
        return CachedBlocks(fmt, out.get("scales"), out.get("mins"), out.get("quants"))

    def store(self, key: str, n: int, k: int, blocks: CachedBlocks) -> None:
        """Write blocks under key (atomically); a failure to write is logged (once), not raised."""
        if self._unwritable:
            return
        tensors = {name: t for name in _TENSORS if (t := getattr(blocks, name)) is not None}
        views = {name: _bytes_of(t) for name, t in tensors.items()}
        header = {
            "version": VERSION,
            "key": key,
            "format": blocks.format,
            "shape": [n, k],
            "tensors": {
                name: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "bytes": len(views[name]),
                    "sha256": self.digest(views[name]),
                }
                for name, t in tensors.items()
            },
        }
        head = json.dumps(header, sort_keys=True).encode()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + struct.pack("<I", len(head)) + head)
                    for name in _TENSORS:
                        if name in views:
                            f.write(views[name])
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            self._unwritable = True
            log.warning("cannot write the GEMV cache in %s (%s); blocks are recovered at every start", self.root, e)
            return
        self.stats.stored += 1


def _expected_tensors(fmt: str, n: int, k: int) -> dict[str, tuple[str, int]]:
    """name -> (dtype, element count) of each tensor a format stores for an [n, k] weight."""
    blocks = n * (k // 32)
    if fmt == "q4_1":
        return {"scales": ("float32", blocks), "mins": ("float32", blocks), "quants": ("uint8", blocks * 16)}
    if fmt == "q8_0":
        return {"scales": ("float32", blocks), "quants": ("int8", blocks * 32)}
    if fmt == "f32":
        return {}
    raise ValueError(f"unknown format {fmt!r}")
