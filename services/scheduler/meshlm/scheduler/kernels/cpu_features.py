"""What this CPU can do, read once from /proc/cpuinfo: the choices that depend on it (--dtype
auto, which attention kernel takes a bf16 extend batch) ask here."""

from __future__ import annotations

import functools

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 math


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo is unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True on CPUs that multiply bf16 natively (AVX512-BF16 or AMX): there a bf16 GEMM runs
    several times faster than fp32. Elsewhere bf16 is emulated and slower than fp32."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_CPU_FLAGS)
