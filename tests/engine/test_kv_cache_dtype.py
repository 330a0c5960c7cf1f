"""--kv-cache-dtype bfloat16 under a float32 model (CPU): a pool of half the bytes a token,
twice the tokens in the same budget, and the greedy tokens of the float32 pool on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.engine import Engine
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool
from meshlm.scheduler.model_executor.cpu_graph_runner import CpuGraphRunner
from meshlm.scheduler.model_executor.model_runner import resolve_kv_dtype

from .conftest import TEST_DEVICE, assert_pools_whole

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
BUDGET_GB = 0.25


def _greedy(eng: Engine, tokenizer) -> list[dict]:
    reqs = [
        {
            "input_ids": list(tokenizer(p).input_ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": 10},
            "return_logprob": True,
        }
        for p in PROMPTS
    ]
    return eng.generate_batch_sync(reqs)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a bf16 pool under a float32 model is read by the CPU kernels")
def test_bf16_pool_under_float32_model(smollm_path: str, smollm_tokenizer, smollm_engine: Engine) -> None:
    want = _greedy(smollm_engine, smollm_tokenizer)
    with Engine(
        dtype="float32", model_path=smollm_path, kv_cache_dtype="bfloat16", kv_cache_memory_gb=BUDGET_GB,
        load_progress=False,
    ) as eng:  # fmt: skip
        runner = eng.scheduler.tp_worker.model_runner
        assert runner.dtype == torch.float32 and runner.token_to_kv_pool.dtype == torch.bfloat16
        assert isinstance(runner.graph_runner, CpuGraphRunner)  # the decode plan takes the bf16 pool
        mc = runner.model_config
        cells = {
            dt: MHATokenToKVPool.cell_size_bytes(mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers, dt)
            for dt in (torch.float32, torch.bfloat16)
        }
        assert cells[torch.float32] == 2 * cells[torch.bfloat16]
        assert runner.max_total_num_tokens == int(BUDGET_GB * (1 << 30)) // cells[torch.bfloat16]
        got = _greedy(eng, smollm_tokenizer)
        assert_pools_whole(eng)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        lp_g = [lp for lp, _ in g["meta_info"]["output_token_logprobs"]]
        lp_w = [lp for lp, _ in w["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp_g, lp_w, strict=True)) < 0.05


def test_kv_dtype_resolution() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) is torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu) is torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, cuda) is torch.bfloat16  # the model's own
    with pytest.raises(ValueError, match="kv-cache-dtype bfloat16 under a float32 model on cuda"):
        resolve_kv_dtype("bfloat16", torch.float32, cuda)
    with pytest.raises(ValueError, match="kv-cache-dtype bfloat16 under a float16 model on cpu"):
        resolve_kv_dtype("bfloat16", torch.float16, cpu)


def test_flag_names_the_field_and_its_values() -> None:
    from meshlm.scheduler.config import SchedulerConfig

    assert SchedulerConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'bfloat16'\), got 'fp8'"):
        SchedulerConfig(kv_cache_dtype="fp8")
