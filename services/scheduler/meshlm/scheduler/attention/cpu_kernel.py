"""Build, load and call the fused CPU decode-attention kernel (csrc/decode_attention.c).

The C source is compiled at first use with the system C compiler (`$CC`, else `cc`) for the CPU
it runs on (-march=native), into `kernels/` of the meshlm cache ($MESHLM_CACHE, else
~/.cache/meshlm; the temp folder when that is not writable). The library's name hashes
the source, the flags and the CPU's model and flags, so a changed source, compiler flag or machine
never loads a stale build; processes that build at once each write a private file and rename it
into place (atomic), so no lock is needed.

The build is two steps on purpose: -ffast-math (vectorised expf and reductions) is a compile
flag only. Linking a shared library with -ffast-math makes GCC add crtfastmath.o, which turns on
flush-to-zero for the whole process at load time and would change torch's own arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from meshlm.scheduler.model_loader import default_cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SUPPORTED_KV_DTYPES = tuple(_KV_DTYPES)
# Tried in order: the fast build, then one without CPU-specific or fast-math flags.
_FLAG_SETS = (
    ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"),
    ("-O2", "-fopenmp", "-fPIC"),
)


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


def _cpu_fingerprint() -> str:
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


def _cache_dir() -> Path:
    candidates = [default_cache_root() / "kernels", Path(tempfile.gettempdir()) / "meshlm-kernels"]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise KernelUnavailable(f"no writable kernel cache folder among {[str(c) for c in candidates]}")


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> None:
    """Compile SOURCE to the shared library `out` (written under a private name, then renamed)."""
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in (
            [cc, *flags, "-c", str(SOURCE), "-o", obj],
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


class DecodeKernel:
    """ctypes binding of meshlm_decode_attention (see the C file for the layouts)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        fn = lib.meshlm_decode_attention
        i64, p = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [p, p, p, ctypes.c_int, i64, i64, p, i64, i64, p, p, i64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_float, p, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of q [B, H, D] (one token per request) over the first lens[b] slots of
        req_to_token[rows[b]], reading k_buf/v_buf [slots, Hkv, D] in place. Returns [B, H, D]
        float32. A row, length or slot out of range raises IndexError (checked in C before any
        KV is read)."""
        b, h, d = q.shape
        hkv = k_buf.shape[1]
        for name, t in (("k_buf", k_buf), ("v_buf", v_buf)):
            if t.device.type != "cpu" or t.dtype not in _KV_DTYPES or t.stride(2) != 1 or t.stride(1) != d:
                raise ValueError(f"{name} must be a CPU [slots, Hkv, D] buffer of {SUPPORTED_KV_DTYPES}")
        if k_buf.stride(0) != v_buf.stride(0) or k_buf.dtype != v_buf.dtype or k_buf.shape[2] != d:
            raise ValueError("k_buf and v_buf must share shape, strides and dtype")
        if req_to_token.dtype != torch.int64 or req_to_token.stride(1) != 1 or req_to_token.device.type != "cpu":
            raise ValueError("req_to_token must be an int64 table with contiguous rows")
        q32 = q.to(torch.float32).contiguous()
        rows = rows.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        out = torch.empty((b, h, d), dtype=torch.float32)
        rc = self._fn(
            q32.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), _KV_DTYPES[k_buf.dtype],
            k_buf.stride(0), k_buf.shape[0], req_to_token.data_ptr(), req_to_token.shape[0],
            req_to_token.stride(0), rows.data_ptr(), lens.data_ptr(), b, h, hkv, d, scale, out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 1:
            raise ValueError(f"decode kernel: unsupported heads/dim (H={h}, Hkv={hkv}, D={d})")
        if rc == 3:
            raise IndexError(
                f"decode kernel: a request's row, length or KV slot is out of range (rows "
                f"{req_to_token.shape[0]} x {req_to_token.stride(0)}, KV slots {k_buf.shape[0]})"
            )
        if rc != 0:
            raise MemoryError("decode kernel: scratch memory could not be allocated")
        return out


@functools.lru_cache(maxsize=1)
def load_decode_kernel() -> DecodeKernel:
    """The kernel for this machine, built on first use; raises KernelUnavailable with the reason."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler found (set CC or install gcc)")
    source = SOURCE.read_bytes()
    cache = _cache_dir()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(),
                                         _cpu_fingerprint().encode()])).hexdigest()[:16]
        lib = cache / f"decode_attention-{key}.so"
        try:
            if not lib.exists():
                _compile(cc, flags, lib)
                log.info("built the CPU decode-attention kernel: %s", lib)
            return DecodeKernel(lib)
        except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    raise KernelUnavailable("; ".join(errors))
