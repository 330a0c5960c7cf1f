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


def cpu_has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    """True on CPUs with AMX bf16 tiles (Sapphire Rapids and later): there torch's flash attention
    multiplies bf16 tiles and beats the C extend kernel; on AVX512-BF16 without AMX (AMD Zen 4/5)
    it is 1.5-3.7x slower than the kernel (`python bench/bench_extend_attention.py --dtype bfloat16`)."""
    flags = cpu_flags() if flags is None else flags
    return "amx_bf16" in flags
