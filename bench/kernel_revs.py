"""Build one of our C kernels as it was at another git revision, to time it against the current
one in the same run (`--baseline-rev` of bench_attention.py and bench_extend_attention.py)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from meshlm.scheduler.kernels.build import LOCAL_INCLUDE, load_library


def library_at(rev: str, source: Path, scratch: Path) -> ctypes.CDLL:
    """The library built from `source` (a C file of the package) and the headers it includes by a
    relative path, as they were at git revision `rev`, laid out under `scratch` as in the package
    so those #include paths resolve."""
    top = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=source.parent, text=True).strip())

    def fetch(path: Path) -> bytes:
        rel = path.resolve().relative_to(top)
        dest = scratch / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=top, capture_output=True, check=True).stdout
        dest.write_bytes(text)
        return text

    for header in LOCAL_INCLUDE.findall(fetch(source)):
        fetch(source.parent / header.decode())
    return load_library(scratch / source.resolve().relative_to(top))
