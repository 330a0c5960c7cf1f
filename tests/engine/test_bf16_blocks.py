"""A bf16 SmolLM2 on a CPU with AVX512-BF16 decodes batches of a few rows through the bf16 block
GEMV over the checkpoint's exact GGUF weights (kernels/gemv_bf16.py); the dense path (the bf16
panel GEMM on CPUs without AMX, else oneDNN) multiplies the weights rounded to bf16. On the
decode step's real activations every block linear is at least as close to the exact float32
product as the dense path's; the step's logits stay as close to the
float32 model's as a bf16 model's are (which of the two bf16 paths lands nearer varies from
token to token: both are bf16 noise around the float32 result)."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.kernels import gemv_bf16
from meshlm.scheduler.kernels.gemm_bf16 import gemm_bf16_or_none
from meshlm.scheduler.layers.cpu_gemm import BF16_GEMV_MAX_ROWS
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from meshlm.scheduler.model_executor.model_runner import ModelRunner
from tests.golden import RAW_PROMPTS


def _runner(path: str, dtype: str) -> ModelRunner:
    cfg = SchedulerConfig(model_path=path, dtype=dtype, max_total_tokens=4096, load_progress=False)
    return ModelRunner(ModelConfig.from_path(path), cfg)


def _prefill_then_decode(runner: ModelRunner, prompts: list[list[int]], next_ids: list[int]) -> torch.Tensor:
    """Each prompt prefilled alone (row i of the table), then one decode step of all of them
    with next_ids as their next tokens (the same for every runner compared): the decode step's
    logits [B, V]."""
    table = runner.req_to_token_pool.req_to_token
    nxt, lens = 0, []
    for i, ids in enumerate(prompts):
        n = len(ids)
        table[i, : n + 1] = torch.arange(nxt, nxt + n + 1)
        fb = ForwardBatch(
            ForwardMode.EXTEND, 1, torch.tensor(ids), torch.arange(n), torch.tensor([n]), torch.tensor([i]),
            table[i, :n].clone(), seq_lens_cpu=[n], extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n],
        )  # fmt: skip
        runner.forward(fb)
        lens.append(n)
        nxt += n + 1
    b = len(prompts)
    rows = torch.arange(b)
    fb = ForwardBatch(
        ForwardMode.DECODE, b, torch.tensor(next_ids), torch.tensor(lens), torch.tensor(lens) + 1, rows,
        table[rows, torch.tensor(lens)].clone(), seq_lens_cpu=[n + 1 for n in lens],
    )  # fmt: skip
    return runner.forward(fb).next_token_logits.float()


def test_bf16_decode_through_blocks_is_as_close_to_float32(smollm_path: str, monkeypatch) -> None:
    if gemv_bf16.gemv_bf16_or_none() is None:
        pytest.skip("no AVX512-BF16 here: the bf16 block GEMV is not built")
    from meshlm.scheduler.kernels.gemv import GemvOps
    from meshlm.scheduler.layers.cpu_gemm import PackedLinear
    from meshlm.scheduler.model_loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm_path)
    prompts = [tok.encode(p) for p in RAW_PROMPTS[:BF16_GEMV_MAX_ROWS]]
    next_ids = [100, 2000, 3000, 4000][: len(prompts)]
    blocks = _runner(smollm_path, "bfloat16")
    packed = [m.packed for m in blocks.model.modules() if getattr(m, "packed", None) is not None]
    assert packed and all(p.gemv_bf16 is not None for p in packed)  # every layer holds its blocks
    assert blocks.model.logits_processor.packed_head.gemv_bf16 is not None
    if gemm_bf16_or_none() is not None:  # AVX512-BF16 without AMX: the panel GEMM, no oneDNN copy
        assert all(p.panels is not None and p.packed is None for p in packed)
    assert blocks.model.model.embed_tokens.weight.dtype == torch.bfloat16

    errors: dict[str, list[float]] = {"blocks": [], "dense": []}
    call = PackedLinear.__call__

    def both_paths(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        y = call(self, x)
        if x.dim() == 2 and x.shape[0] <= self.gemv_rows and self.small is not None:
            exact = x.float() @ GemvOps.dequantize(self.small).t()
            rows, self.gemv_rows = self.gemv_rows, 0
            dense = call(self, x)
            self.gemv_rows = rows
            for name, out in (("blocks", y), ("dense", dense)):
                errors[name].append(float((out.float() - exact).abs().mean() / exact.abs().mean()))
        return y

    monkeypatch.setattr(PackedLinear, "__call__", both_paths)
    got = _prefill_then_decode(blocks, prompts, next_ids)
    monkeypatch.setattr(PackedLinear, "__call__", call)
    assert len(errors["blocks"]) >= 4 * 30 + 1  # every linear of the decode step and the head (and short prompts)
    assert sum(errors["blocks"]) <= sum(errors["dense"]), (sum(errors["blocks"]), sum(errors["dense"]))

    ref = _prefill_then_decode(_runner(smollm_path, "float32"), prompts, next_ids)
    monkeypatch.setattr("meshlm.scheduler.model_executor.model_runner.gemv_bf16_or_none", lambda: None)
    plain = _prefill_then_decode(_runner(smollm_path, "bfloat16"), prompts, next_ids)
    err_blocks, err_plain = float((got - ref).abs().mean()), float((plain - ref).abs().mean())
    assert err_blocks <= 2.5 * err_plain, (err_blocks, err_plain)
