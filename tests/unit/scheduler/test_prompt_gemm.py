"""The prompt GEMM choice (layers/prompt_gemm.py): a forced library is the one a float32
PackedLinear multiplies prompt chunks with, and gives F.linear's result; `auto` takes MKL only
when it is clearly faster, times each shape once, and a restart reads the choice back from the
cache folder instead of timing again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.layers import prompt_gemm
from meshlm.scheduler.layers.cpu_gemm import PackedLinear, PackPlan, prepack_supported, try_pack
from meshlm.scheduler.layers.prompt_gemm import MKL_MARGIN, PromptGemmChoice

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")


@pytest.mark.parametrize("mode", ["onednn", "mkl"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_forced_library_multiplies_prompt_chunks(mode: str, bias: bool) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 80) * 0.05, torch.randn(96) if bias else None
    packed = PackedLinear(w, b, prompt_gemm=PromptGemmChoice(mode))
    assert (packed.weight_t is not None, packed.packed is not None) == (mode == "mkl", mode == "onednn")
    for rows in (1, 37, 300):
        x = torch.randn(rows, 80)
        assert torch.allclose(packed(x), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    assert packed.matches(w, b)


def test_a_bf16_weight_keeps_onednn() -> None:
    packed = try_pack(torch.randn(32, 64), None, PackPlan(torch.bfloat16, prompt_gemm=PromptGemmChoice("mkl")))
    assert packed is None or packed.weight_t is None


def _timer(onednn_s: float, mkl_s: float, calls: list[int]):
    def fake(onednn, mkl) -> tuple[float, float]:
        onednn(), mkl()  # both are real calls of the two libraries
        calls.append(1)
        return onednn_s, mkl_s

    return fake


@pytest.mark.parametrize(
    "mkl_s,want", [(0.5, "mkl"), (MKL_MARGIN - 0.01, "mkl"), (MKL_MARGIN + 0.01, "onednn"), (2.0, "onednn")]
)
def test_auto_takes_mkl_only_when_clearly_faster(monkeypatch, tmp_path: Path, mkl_s: float, want: str) -> None:
    calls: list[int] = []
    monkeypatch.setattr(prompt_gemm, "time_prompt_gemms", _timer(1.0, mkl_s, calls))
    choice = PromptGemmChoice("auto", cache_dir=tmp_path)
    plan = PackPlan(torch.float32, prompt_gemm=choice)
    first, second = (try_pack(torch.randn(48, 32), None, plan) for _ in range(2))
    assert first is not None and second is not None
    assert ((first.weight_t is not None), (second.weight_t is not None)) == (want == "mkl", want == "mkl")
    assert len(calls) == 1  # one timing per shape
    assert choice.by_shape == {(48, 32, False): want}

    # a restart reads the choice from the cache folder: no timing
    monkeypatch.setattr(prompt_gemm, "time_prompt_gemms", _timer(1.0, 1.0 if want == "mkl" else 0.1, calls))
    again = PromptGemmChoice("auto", cache_dir=tmp_path)
    w = torch.randn(48, 32)
    packs: list[int] = []

    def pack() -> torch.Tensor:
        packs.append(1)
        return torch.ops.mkldnn._reorder_linear_weight(w, 64)

    assert again.choose(w, None, pack) == want
    assert len(calls) == 1 and not packs  # a cached choice packs nothing

    # the same shape with a bias is its own layout: timed on its own (this timer says the opposite)
    assert again.choose(w, torch.randn(48), pack) != want
    assert len(calls) == 2 and len(packs) == 1


def test_auto_times_real_libraries_and_picks_one(tmp_path: Path) -> None:
    choice = PromptGemmChoice("auto", cache_dir=tmp_path)
    packed = PackedLinear(torch.randn(64, 48), None, prompt_gemm=choice)
    assert list(choice.by_shape.values()) in (["onednn"], ["mkl"])
    assert len(list(tmp_path.glob("prompt-gemm-*.txt"))) == 1
    x = torch.randn(300, 48)
    assert packed(x).shape == (300, 64)


def test_bad_modes_are_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_gemm must be one of"):
        PromptGemmChoice("fast")
    with pytest.raises(ValueError, match="cpu_prompt_gemm must be one of"):
        SchedulerConfig(cpu_prompt_gemm="fast")
