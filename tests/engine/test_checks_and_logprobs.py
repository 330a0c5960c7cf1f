"""Engine request checks and logprobs on SmolLM2-135M in float32: prompts and parameters out of
range are rejected naming the field (and disturb nothing else), input logprobs match HF, chunked
or cached prefixes change none of them. Every test ends with the KV pools whole."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from meshlm.scheduler.engine import Engine, RequestError

from .conftest import assert_pools_whole
from .prompts import STORY, chat, greedy


@pytest.fixture
def engine(smollm_engine: Engine):
    """The shared engine; after the test its pools must be whole again."""
    yield smollm_engine
    assert_pools_whole(smollm_engine)


@pytest.fixture(scope="module")
def small_engine(smollm_path: str):
    """A 128-token context (cheap length checks) and 16-token prefill chunks."""
    eng = Engine(
        dtype="float32",
        model_path=smollm_path,
        context_length=128,
        chunked_prefill_size=16,
        max_total_tokens=2048,
        load_progress=False,
    )
    yield eng
    eng.shutdown()


LP_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within a few decades printing shops had spread to more than two hundred European cities."
)


# ---- 4. request checks -------------------------------------------------------------------
def test_prompt_longer_than_context_is_rejected(small_engine: Engine) -> None:
    for n in (130, 128):
        with pytest.raises(RequestError) as err:
            small_engine.generate_sync(input_ids=[100] * n, sampling_params=greedy(4))
        assert err.value.status_code == 400
        assert f"{n} tokens" in err.value.message and "128 tokens" in err.value.message
    assert_pools_whole(small_engine)


def test_max_new_tokens_is_clamped_to_the_context(small_engine: Engine) -> None:
    # A request may hold context_length - 1 tokens (prompt + outputs); see RequestValidator.validate.
    r = small_engine.generate_sync(input_ids=[100] * 120, sampling_params={"max_new_tokens": 100, "ignore_eos": True})
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 128 - 120 - 1}
    assert len(r["output_ids"]) == 7
    assert_pools_whole(small_engine)


BAD_PARAMS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"no_such_param": 1}, "no_such_param"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"logit_bias": {"not-a-token": 1.0}}, "logit_bias"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize("params,field", BAD_PARAMS, ids=[f for _, f in BAD_PARAMS])
def test_invalid_sampling_params_are_rejected(engine: Engine, params: dict, field: str) -> None:
    with pytest.raises(RequestError) as err:
        engine.generate_sync("Hello", sampling_params=params)
    assert err.value.status_code == 400
    assert field in err.value.message


def test_invalid_logprob_args_are_rejected(engine: Engine) -> None:
    ids = engine.tokenize(LP_TEXT)
    for kwargs, field in (
        ({"logprob_start_len": len(ids)}, "logprob_start_len"),
        ({"logprob_start_len": len(ids) + 5}, "logprob_start_len"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"token_ids_logprob": [10**9]}, "token_ids_logprob"),
    ):
        with pytest.raises(RequestError) as err:
            engine.generate_sync(input_ids=ids, sampling_params=greedy(2), return_logprob=True, **kwargs)
        assert err.value.status_code == 400 and field in err.value.message


def test_rejected_requests_do_not_disturb_others(engine: Engine) -> None:
    story = chat(engine, STORY)
    expected = engine.generate_sync(input_ids=story, sampling_params=greedy(16))["output_ids"]
    too_long = [100] * (engine.scheduler.max_req_len + 1)

    async def run() -> list[Any]:
        reqs = [engine.generate(input_ids=story, sampling_params=greedy(16))]
        reqs += [engine.generate(input_ids=story, sampling_params=p) for p, _ in BAD_PARAMS[:8]]
        reqs += [
            engine.generate(input_ids=too_long, sampling_params=greedy(4)),
            engine.generate(input_ids=story, sampling_params=greedy(4), return_logprob=True, logprob_start_len=10**6),
            engine.generate(input_ids=story, sampling_params=greedy(16)),
        ]
        return list(await asyncio.gather(*reqs, return_exceptions=True))

    res = asyncio.run(run())
    assert all(isinstance(r, RequestError) and r.status_code == 400 for r in res[1:-1])
    assert res[0]["output_ids"] == expected and res[-1]["output_ids"] == expected


# ---- 5. logprobs -------------------------------------------------------------------------
def _hf_logprobs(hf_smollm, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits; row j predicts prompt token j + 1."""
    with torch.no_grad():
        logits = hf_smollm(torch.tensor([ids], device=hf_smollm.device)).logits[0]
        return torch.log_softmax(logits.float(), dim=-1).cpu()


def _logprob_request(engine: Engine, ids: list[int], start: int = 0) -> dict[str, Any]:
    return engine.generate_sync(
        input_ids=ids,
        sampling_params=greedy(4),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
        token_ids_logprob=[11, 500, ids[3]],
    )["meta_info"]


def test_input_logprobs_match_hf(engine: Engine, hf_smollm) -> None:
    ids = engine.tokenize(LP_TEXT)
    watch = [11, 500, ids[3]]
    assert engine.flush_cache().success
    meta = _logprob_request(engine, ids)
    ref = _hf_logprobs(hf_smollm, ids)
    lps, tops, by_id = meta["input_token_logprobs"], meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(lps) == len(tops) == len(by_id) == len(ids)
    assert [t for _, t in lps] == ids
    assert lps[0][0] is None and tops[0] == [] and by_id[0] == []
    for k in range(1, len(ids)):
        row = ref[k - 1]
        assert abs(lps[k][0] - row[ids[k]].item()) < 1e-3
        vals = [v for v, _ in tops[k]]
        assert len(vals) == 3 and vals == sorted(vals, reverse=True)
        assert [t for _, t in tops[k]] == row.topk(3).indices.tolist()
        assert max(abs(v - r) for v, r in zip(vals, row.topk(3).values.tolist())) < 1e-3
        assert vals[0] >= lps[k][0] - 1e-5
        for v, t in tops[k]:
            if t == ids[k]:
                assert abs(v - lps[k][0]) < 1e-5
        assert [t for _, t in by_id[k]] == watch
        assert max(abs(v - row[t].item()) for v, t in by_id[k]) < 1e-3
    outs, out_tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(outs) == len(out_tops) == 4
    for (lp, tok), top in zip(outs, out_tops):
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy takes the top token


def test_chunked_prefill_input_logprobs_equal_unchunked(engine: Engine, small_engine: Engine) -> None:
    ids = engine.tokenize(LP_TEXT)
    assert len(ids) > 3 * 16  # four or more chunks
    whole = _logprob_request(engine, ids)
    chunked = _logprob_request(small_engine, ids)
    assert [t for _, t in chunked["input_token_logprobs"]] == ids
    assert chunked["input_token_logprobs"][0][0] is None
    pairs = zip(whole["input_token_logprobs"][1:], chunked["input_token_logprobs"][1:])
    diffs = [abs(a - b) for (a, _), (b, _) in pairs]
    assert max(diffs) < 1e-4
    assert [[t for _, t in row] for row in chunked["input_top_logprobs"]] == [
        [t for _, t in row] for row in whole["input_top_logprobs"]
    ]
    assert len(chunked["input_token_ids_logprobs"]) == len(ids)
    assert [t for _, t in chunked["output_token_logprobs"]] == [t for _, t in whole["output_token_logprobs"]]
    assert_pools_whole(small_engine)


def test_cached_prefix_still_returns_input_logprobs(engine: Engine) -> None:
    ids = engine.tokenize(LP_TEXT)
    assert engine.flush_cache().success
    first = _logprob_request(engine, ids)
    again = _logprob_request(engine, ids)
    assert again["cached_tokens"] == 0  # the match stops before the first wanted logprob
    assert len(again["input_token_logprobs"]) == len(ids)
    assert (
        max(abs(a - b) for (a, _), (b, _) in zip(first["input_token_logprobs"][1:], again["input_token_logprobs"][1:]))
        < 1e-5
    )
    start = 20
    tail = _logprob_request(engine, ids, start)
    assert tail["cached_tokens"] == start - 1  # row start-1 predicts token start: computed again
    assert [t for _, t in tail["input_token_logprobs"]] == ids[start:]
    assert (
        max(abs(a - b) for (a, _), (b, _) in zip(first["input_token_logprobs"][start:], tail["input_token_logprobs"]))
        < 1e-4
    )
    assert len(tail["input_top_logprobs"]) == len(ids) - start
