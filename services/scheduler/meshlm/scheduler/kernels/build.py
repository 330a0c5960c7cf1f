"""Build and load a C source of ours as a shared library for the CPU it runs on.

The source is compiled at first use with the system C compiler (`$CC`, else `cc`) for this CPU
(-march=native), into `kernels/` of the meshlm cache ($MESHLM_CACHE, else ~/.cache/meshlm; the
temp folder when that is not writable). The library's name hashes the source (with the headers
it includes by `#include "path"`, relative to its own folder), the compiler, the flags and the CPU's
model and flags, so a changed source, header, compiler flag or machine never loads a stale build;
processes that build at once each write a private file and rename it into place (atomic), so no
lock is needed.

The build is two steps on purpose: -ffast-math (vectorised expf and reductions) is a compile
flag only. Linking a shared library with -ffast-math makes GCC add crtfastmath.o, which turns on
flush-to-zero for the whole process at load time and would change torch's own arithmetic.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from meshlm.scheduler.model_loader import default_cache_root

log = logging.getLogger(__name__)

# Tried in order: the fast build, then one without CPU-specific or fast-math flags. GCC's
# vectorizer prefers 256-bit vectors even on AVX-512 CPUs; 512-bit ones are asked for (on CPUs
# without AVX-512 the flag changes nothing).
FLAG_SETS = (
    ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC"),
    ("-O2", "-fopenmp", "-fPIC"),
)


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why."""


def cpu_fingerprint() -> str:
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                parts.append(line)
                if len(parts) >= 3:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def cache_dir() -> Path:
    candidates = [default_cache_root() / "kernels", Path(tempfile.gettempdir()) / "meshlm-kernels"]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise KernelUnavailable(f"no writable kernel cache folder among {[str(c) for c in candidates]}")


LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path) -> bytes:
    """What a build of `source` depends on: its text and, in order, that of each header it includes
    with quotes, by a path relative to its own folder (one level: our headers include no headers
    of ours)."""
    text = source.read_bytes()
    headers = [source.parent / name.decode() for name in LOCAL_INCLUDE.findall(text)]
    return b"\0".join([text, *(h.read_bytes() for h in headers if h.is_file())])


def compile_library(cc: str, flags: tuple[str, ...], source: Path, out: Path) -> None:
    """Compile `source` to the shared library `out` (written under a private name, then renamed)."""
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in (
            [cc, *flags, "-c", str(source), "-o", obj],
            [cc, "-shared", "-fopenmp", obj, "-o", tmp, "-lm"],  # no -ffast-math here (see above)
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                raise KernelUnavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        for p in (tmp, obj):
            if os.path.exists(p):
                os.unlink(p)


def load_library(source: Path) -> ctypes.CDLL:
    """`source` built for this machine (cached), loaded; raises KernelUnavailable with the reason."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler found (set CC or install gcc)")
    text = source_bytes(source)
    cache = cache_dir()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(
            b"\0".join([text, cc.encode(), " ".join(flags).encode(), cpu_fingerprint().encode()])
        ).hexdigest()[:16]
        lib = cache / f"{source.stem}-{key}.so"
        try:
            if not lib.exists():
                log.info("compiling %s for this CPU (%s %s), cached as %s", source.name, cc, " ".join(flags), lib)
                t0 = time.perf_counter()
                compile_library(cc, flags, source, lib)
                log.info("compiled %s in %.1fs", source.name, time.perf_counter() - t0)
            return ctypes.CDLL(str(lib))
        except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    raise KernelUnavailable("; ".join(errors))
