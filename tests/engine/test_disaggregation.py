"""Prefill/decode disaggregation in process: a prefill engine computes prompts and hands KV +
first token to a decode engine, which finishes the requests. Outputs equal HF's golden tokens
and logprobs, under chunked prefill and paging; aborts and bad handovers leave both pools whole."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshlm.scheduler.engine import Engine, RequestError
from meshlm.scheduler.managers.io_struct import PrefilledReq, TokenDelta, TokenizedGenerateReqInput
from meshlm.scheduler.sampling.sampling_params import SamplingParams

from .conftest import GOLDEN_NEW_TOKENS, assert_pools_whole

GREEDY = {"temperature": 0, "max_new_tokens": GOLDEN_NEW_TOKENS}


def make_pair(path: str, **overrides) -> tuple[Engine, Engine]:
    common = dict(model_path=path, dtype="float32", max_total_tokens=8192, load_progress=False, **overrides)
    decode = Engine(disaggregation_mode="decode", **common)
    prefill = Engine(disaggregation_mode="prefill", decode_engine=decode, **common)
    return prefill, decode


@pytest.fixture(scope="module")
def pair(smollm_path: str):
    prefill, decode = make_pair(smollm_path)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_greedy_tokens_and_logprobs_match_hf(pair, golden) -> None:
    prefill, decode = pair
    reqs = [{"input_ids": g.input_ids, "sampling_params": GREEDY, "return_logprob": True} for g in golden]
    results = prefill.generate_batch_sync(reqs)
    for g, r in zip(golden, results):
        assert r["output_ids"] == g.output_ids
        ours = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
        assert len(ours) == len(g.logprobs)
        assert max(abs(a - b) for a, b in zip(ours, g.logprobs)) < 1e-3
    assert_pools_whole(prefill)  # (also waits until each loop has recorded its last step)
    assert_pools_whole(decode)
    # Every token after the first was decoded on the decode engine; no prefill ran there.
    assert decode.scheduler.stats.extend_tokens == 0
    assert decode.scheduler.stats.generation_tokens == sum(len(g.output_ids) - 1 for g in golden)
    assert prefill.scheduler.stats.generation_tokens == 0


def test_input_logprobs_and_prefix_cache_survive_the_handover(pair, golden) -> None:
    prefill, _ = pair
    g = golden[0]
    first = prefill.generate_sync(
        input_ids=g.input_ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
    )
    again = prefill.generate_sync(input_ids=g.input_ids, sampling_params=GREEDY)
    assert first["output_ids"] == g.output_ids == again["output_ids"]
    assert len(first["meta_info"]["input_token_logprobs"]) == len(g.input_ids)
    assert again["meta_info"]["cached_tokens"] > 0  # the prefill side kept the prompt's KV


def test_stop_on_the_first_token_never_reaches_decode(pair, golden) -> None:
    prefill, decode = pair
    g = golden[1]
    assert_pools_whole(decode)
    before = decode.scheduler.stats.generation_tokens
    r = prefill.generate_sync(input_ids=g.input_ids, sampling_params={"temperature": 0, "max_new_tokens": 1})
    assert r["output_ids"] == g.output_ids[:1]
    assert_pools_whole(decode)
    assert decode.scheduler.stats.generation_tokens == before


def test_abort_mid_decode_frees_both_pools(pair, golden) -> None:
    prefill, decode = pair

    async def run() -> None:
        stream = prefill.generate_stream(
            input_ids=golden[2].input_ids, sampling_params={"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.aclose()

    asyncio.run(run())
    assert_pools_whole(prefill)
    assert_pools_whole(decode)


@pytest.mark.parametrize("overrides", [{"chunked_prefill_size": 16, "page_size": 4}])
def test_chunked_paged_handover_matches_hf(smollm_path: str, golden, overrides) -> None:
    prefill, decode = make_pair(smollm_path, **overrides)
    try:
        results = prefill.generate_batch_sync([{"input_ids": g.input_ids, "sampling_params": GREEDY} for g in golden])
        assert [r["output_ids"] for r in results] == [g.output_ids for g in golden]
        assert_pools_whole(prefill)
        assert_pools_whole(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_bad_handover_is_rejected_naming_the_field(pair, golden) -> None:
    _, decode = pair
    g = golden[0]
    pool = decode.scheduler.memory.kv_pool
    wrong = torch.zeros(pool.layer_num, 2, len(g.input_ids) - 1, pool.head_num, pool.head_dim)

    async def run() -> None:
        rid, st = decode._register("bad-kv", SamplingParams(max_new_tokens=4))
        try:
            decode.port.put(
                PrefilledReq(
                    req=TokenizedGenerateReqInput(
                        rid=rid, input_ids=g.input_ids, sampling_params=SamplingParams(max_new_tokens=4)
                    ),
                    output_ids=[g.output_ids[0]],
                    kv=wrong,
                )
            )
            delta = await asyncio.wait_for(st.queue.get(), 30)
            assert isinstance(delta, TokenDelta)
            decode._output(rid, st, delta)
        finally:
            decode._unregister(rid)

    with pytest.raises(RequestError, match="kv must have shape"):
        asyncio.run(run())
    assert_pools_whole(decode)


def test_prefill_engine_needs_a_decode_engine(smollm_path: str) -> None:
    with pytest.raises(ValueError, match="decode_engine"):
        Engine(dtype="float32", model_path=smollm_path, disaggregation_mode="prefill", load_progress=False)
