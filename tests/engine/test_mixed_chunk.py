"""--enable-mixed-chunk: running requests take their decode step inside prefill batches, and
outputs (tokens and logprobs) stay those of HF transformers; pools are whole afterwards (under
retraction: tests/engine/test_golden.py::test_small_pool_forces_retraction)."""

from __future__ import annotations

import asyncio

from meshlm.scheduler.engine import Engine

from .conftest import GOLDEN_NEW_TOKENS, assert_pools_whole

GREEDY = {"temperature": 0, "max_new_tokens": GOLDEN_NEW_TOKENS}


def test_mixed_batches_keep_golden_tokens_and_logprobs(smollm_path: str, golden) -> None:
    # A 16-token chunk spreads the prompts over many rounds: requests whose prompt is done
    # decode inside the batches that prefill the others.
    many = (golden * 3)[:12]
    with Engine(
        dtype="float32",
        model_path=smollm_path,
        max_total_tokens=8192,
        load_progress=False,
        enable_mixed_chunk=True,
        chunked_prefill_size=16,
    ) as eng:
        reqs = [{"input_ids": g.input_ids, "sampling_params": GREEDY, "return_logprob": True} for g in many]
        results = eng.generate_batch_sync(reqs)
        assert eng.scheduler.stats.mixed_decode_tokens > 0
        for g, r in zip(many, results):
            assert r["output_ids"] == g.output_ids
            ours = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(ours, g.logprobs)) < 1e-3
        assert_pools_whole(eng)


def test_arrivals_during_decode_are_mixed_in(smollm_path: str, golden) -> None:
    """Requests that arrive while others decode prefill in batches that also decode those."""
    with Engine(
        dtype="float32", model_path=smollm_path, max_total_tokens=8192, load_progress=False, enable_mixed_chunk=True
    ) as eng:

        async def one(g, delay: float) -> list[int]:
            await asyncio.sleep(delay)
            out = await eng.generate(input_ids=g.input_ids, sampling_params=GREEDY)
            return out["output_ids"]

        async def run() -> list[list[int]]:
            return await asyncio.gather(*(one(g, 0.15 * i) for i, g in enumerate(golden)))

        got = asyncio.run(run())
        assert got == [g.output_ids for g in golden]
        assert eng.scheduler.stats.mixed_decode_tokens > 0
        assert_pools_whole(eng)
