"""--dtype auto: bfloat16 only on CPUs with native bf16 math, float32 on other CPUs, the
checkpoint's dtype on CUDA; explicit dtypes are taken as given."""

from __future__ import annotations

import types

import pytest
import torch

from meshlm.scheduler.kernels.cpu_features import cpu_flags, cpu_has_amx_bf16, cpu_has_native_bf16
from meshlm.scheduler.model_executor.model_runner import resolve_dtype

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def model(**hf: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(hf=dict(hf))


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (AVX2_ONLY, torch.float32),
        (AVX512_NO_BF16, torch.float32),  # AVX-512 without BF16 emulates bf16: slower than fp32
        (AVX512_NO_BF16 | {"avx512_bf16"}, torch.bfloat16),
        (AVX512_NO_BF16 | {"amx_bf16", "amx_tile"}, torch.bfloat16),
        (frozenset(), torch.float32),  # flags unreadable: the safe choice
    ],
)
def test_auto_on_cpu_follows_native_bf16(flags: frozenset[str], want: torch.dtype) -> None:
    assert resolve_dtype("auto", model(torch_dtype="bfloat16"), CPU, flags) is want


def test_auto_on_cuda_takes_the_checkpoint_dtype() -> None:
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", model(torch_dtype="float16"), cuda, AVX2_ONLY) is torch.float16
    assert resolve_dtype("auto", model(), cuda, AVX2_ONLY) is torch.bfloat16


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_is_kept(name: str) -> None:
    assert resolve_dtype(name, model(), CPU, AVX2_ONLY) is getattr(torch, name)
    assert resolve_dtype(name, model(), CPU, AVX512_NO_BF16 | {"amx_bf16"}) is getattr(torch, name)


def test_bad_dtype_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp64", model(), CPU, AVX2_ONLY)


def test_this_machine_reads_its_own_flags() -> None:
    flags = cpu_flags()
    assert cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert cpu_has_amx_bf16() == ("amx_bf16" in flags)
    assert not cpu_has_amx_bf16(frozenset({"avx512f", "avx512_bf16"}))
