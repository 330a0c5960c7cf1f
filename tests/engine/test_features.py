"""Engine features beyond greedy golden tokens, on SmolLM2-135M in float32: prefix caching,
sampling controls, streaming and abort (request checks and logprobs: test_checks_and_logprobs.py).
Every test ends with the KV pools whole (free + evictable == capacity, nothing locked, no request row held)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from meshlm.scheduler.engine import Engine, RequestError

from .conftest import assert_pools_whole
from .prompts import STORY, chat, greedy

SYSTEM = (
    "You are the assistant of a small bakery in Lyon. Answer in one short sentence, quote prices "
    "in euros, recommend the bread of the day when it fits, and never invent opening hours or "
    "products that are not on the menu: baguette, pain de campagne, croissant, brioche. "
) * 2
QUESTIONS = [
    "What bread do you sell?",
    "Do you have croissants today?",
    "How much is a baguette?",
    "Is the brioche sweet?",
]
EMOJI = "Write three emoji about the sea 🌊 and say 你好"


def common_prefix_len(seqs: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n and s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


async def collect(gen) -> list[dict[str, Any]]:
    return [d async for d in gen]


@pytest.fixture
def engine(smollm_engine: Engine):
    """The shared engine; after the test its pools must be whole again."""
    yield smollm_engine
    assert_pools_whole(smollm_engine)


@pytest.fixture(scope="module")
def bakery(smollm_engine: Engine) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts sharing a long system prompt, and each one's greedy output on an empty cache."""
    prompts = [chat(smollm_engine, q, SYSTEM) for q in QUESTIONS]
    outputs = []
    for ids in prompts:
        assert smollm_engine.flush_cache().success
        r = smollm_engine.generate_sync(input_ids=ids, sampling_params=greedy(12))
        assert r["meta_info"]["cached_tokens"] == 0
        outputs.append(r["output_ids"])
    return prompts, outputs


# ---- 1. prefix caching -------------------------------------------------------------------
def test_shared_prefix_is_computed_once(engine: Engine, bakery) -> None:
    prompts, expected = bakery
    shared = common_prefix_len(prompts)
    assert shared >= 100
    stats = engine.scheduler.stats
    assert engine.flush_cache().success

    before = stats.extend_tokens
    first = engine.generate_sync(input_ids=prompts[0], sampling_params=greedy(12))
    assert first["meta_info"]["cached_tokens"] == 0
    assert stats.extend_tokens - before == len(prompts[0])

    before = stats.extend_tokens
    rest = engine.generate_batch_sync([{"input_ids": p, "sampling_params": greedy(12)} for p in prompts[1:]])
    cached = [r["meta_info"]["cached_tokens"] for r in rest]
    assert all(c >= shared for c in cached), (cached, shared)
    assert stats.extend_tokens - before == sum(len(p) - c for p, c in zip(prompts[1:], cached))
    assert [first["output_ids"]] + [r["output_ids"] for r in rest] == expected


def test_shared_prefix_submitted_together_is_computed_once(engine: Engine, bakery) -> None:
    """Requests sharing a prefix that arrive in the same round: one computes the prefix, the
    others wait a round and reuse it from the radix cache (in-batch prefix sharing)."""
    prompts, expected = bakery
    shared = common_prefix_len(prompts)
    stats = engine.scheduler.stats
    assert engine.flush_cache().success
    before = stats.extend_tokens
    res = engine.generate_batch_sync([{"input_ids": p, "sampling_params": greedy(12)} for p in prompts])
    cached = sorted(r["meta_info"]["cached_tokens"] for r in res)
    assert cached[0] == 0 and all(c >= shared for c in cached[1:]), (cached, shared)
    assert stats.extend_tokens - before == sum(len(p) for p in prompts) - sum(cached)
    assert [r["output_ids"] for r in res] == expected


def test_max_new_tokens_zero_is_prefill_only(engine: Engine) -> None:
    out = engine.generate_sync(input_ids=engine.tokenize("Hello there"), sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_a_chunked_prompt_is_logged_per_chunk_and_counted_once(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler's "Prefill batch." lines (managers/batch_log.py) follow a 2500-token prompt
    through its 2048-token chunk and the rest; its prompt tokens count once in the stats."""
    assert engine.flush_cache().success
    caplog.set_level(logging.INFO, logger="meshlm.scheduler")
    stats = engine.scheduler.stats
    before = stats.prompt_tokens, stats.cached_tokens
    ids = list(range(1000, 3500))
    engine.generate_sync(input_ids=ids, sampling_params=greedy(2))
    engine.get_load()  # the loop has logged everything before it
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch.")]
    assert [line.split(", token usage")[0] for line in lines] == [
        "Prefill batch. #new-seq: 1, #new-token: 2048, #cached-token: 0, #mixed-decode: 0",
        "Prefill batch. #new-seq: 1, #new-token: 452, #cached-token: 0, #mixed-decode: 0",
    ]
    assert all("#running-req: 0, #queue-req: 0, forward: " in line for line in lines)
    assert (stats.prompt_tokens - before[0], stats.cached_tokens - before[1]) == (2500, 0)


def test_prefix_reuse_in_waves_with_pages_and_lpm(smollm_path: str, engine: Engine, bakery) -> None:
    """page_size 16 + lpm + 64-token chunks: the second wave (shared-prefix requests submitted
    together with unrelated ones) reuses the first wave's prefix, rounded down to pages."""
    prompts, expected = bakery
    shared = common_prefix_len(prompts)
    others = [engine.tokenize("The quick brown fox"), engine.tokenize("def fibonacci(n):")]
    other_out = [engine.generate_sync(input_ids=o, sampling_params=greedy(12))["output_ids"] for o in others]
    with Engine(
        dtype="float32",
        model_path=smollm_path,
        page_size=16,
        schedule_policy="lpm",
        chunked_prefill_size=64,
        max_total_tokens=4096,
        load_progress=False,
    ) as eng:
        stats = eng.scheduler.stats
        before = stats.extend_tokens
        first = eng.generate_sync(input_ids=prompts[0], sampling_params=greedy(12))
        assert first["meta_info"]["cached_tokens"] == 0
        assert stats.extend_tokens - before == len(prompts[0])

        wave = [others[0]] + prompts[1:] + [others[1]]
        before = stats.extend_tokens
        res = eng.generate_batch_sync([{"input_ids": p, "sampling_params": greedy(12)} for p in wave])
        cached = [r["meta_info"]["cached_tokens"] for r in res]
        assert cached[0] == 0 and cached[-1] == 0
        assert all(c >= shared // 16 * 16 and c % 16 == 0 for c in cached[1:-1]), cached
        assert stats.extend_tokens - before == sum(len(p) - c for p, c in zip(wave, cached))
        assert [first["output_ids"]] + [r["output_ids"] for r in res[1:-1]] == expected
        assert [res[0]["output_ids"], res[-1]["output_ids"]] == other_out
        assert_pools_whole(eng)


# ---- 3. sampling -------------------------------------------------------------------------
def test_sampling_seed_is_reproducible_when_batched(engine: Engine) -> None:
    story = chat(engine, STORY)
    seeded = {"temperature": 0.8, "max_new_tokens": 24, "sampling_seed": 1234, "ignore_eos": True}
    alone = engine.generate_sync(input_ids=story, sampling_params=seeded)["output_ids"]
    assert len(alone) == 24
    res = engine.generate_batch_sync(
        [
            {"input_ids": chat(engine, "Name a color."), "sampling_params": {"temperature": 1.0, "max_new_tokens": 16}},
            {"input_ids": story, "sampling_params": seeded},
            {"input_ids": story, "sampling_params": {**seeded, "sampling_seed": 4321}},
            {"input_ids": engine.tokenize("The quick brown fox"), "sampling_params": greedy(12)},
        ]
    )
    assert res[1]["output_ids"] == alone
    assert res[2]["output_ids"] != alone
    top1 = engine.generate_sync(input_ids=story, sampling_params=greedy(24, ignore_eos=True))["output_ids"]
    assert alone != top1  # temperature 0.8 really samples


def test_top_k_1_equals_greedy(engine: Engine) -> None:
    story = chat(engine, STORY)
    res = engine.generate_batch_sync(
        [
            {"input_ids": story, "sampling_params": greedy(24, ignore_eos=True)},
            {"input_ids": story, "sampling_params": {**greedy(24, ignore_eos=True), "temperature": 0.8, "top_k": 1}},
            {"input_ids": story, "sampling_params": {"temperature": 1.3, "top_p": 0.9, "max_new_tokens": 24}},
        ]
    )
    assert res[0]["output_ids"] == res[1]["output_ids"]


def test_penalties_change_the_output(engine: Engine) -> None:
    emoji = chat(engine, EMOJI)  # greedy repeats the same emoji over and over
    story = chat(engine, STORY)

    def max_count(out: list[int]) -> int:
        return max(out.count(t) for t in set(out))

    res = engine.generate_batch_sync(
        [
            {"input_ids": emoji, "sampling_params": greedy(24, ignore_eos=True)},
            {"input_ids": emoji, "sampling_params": greedy(24, ignore_eos=True, frequency_penalty=1.5)},
            {"input_ids": story, "sampling_params": greedy(24, ignore_eos=True)},
            {"input_ids": story, "sampling_params": greedy(24, ignore_eos=True, presence_penalty=2.0)},
            {"input_ids": story, "sampling_params": greedy(24, ignore_eos=True, repetition_penalty=1.5)},
        ]
    )
    emoji_plain, emoji_freq, plain, pres, rep = (r["output_ids"] for r in res)
    assert max_count(emoji_freq) < max_count(emoji_plain)
    assert pres != plain and rep != plain


def test_logit_bias_forces_a_token(engine: Engine) -> None:
    token = engine.tokenize(" cat")[0]
    sp = greedy(10, logit_bias={str(token): 100.0})
    r = engine.generate_sync(input_ids=chat(engine, STORY), sampling_params=sp)
    assert r["output_ids"] == [token] * 10
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_min_new_tokens_defers_eos(engine: Engine) -> None:
    ids = chat(engine, "Say only the word yes.")
    eos = set(engine.model_config.eos_token_ids)
    short = engine.generate_sync(input_ids=ids, sampling_params=greedy(40))["output_ids"]
    assert len(short) < 10 and short[-1] in eos
    r = engine.generate_sync(input_ids=ids, sampling_params=greedy(40, min_new_tokens=10))
    out = r["output_ids"]
    assert len(out) >= 10
    assert not eos & set(out[:-1])  # EOS, if any, only ends the output


def test_stop_token_ids(engine: Engine) -> None:
    story = chat(engine, STORY)
    plain = engine.generate_sync(input_ids=story, sampling_params=greedy(24, ignore_eos=True))["output_ids"]
    stop = plain[4]
    assert stop not in plain[:4]
    r = engine.generate_sync(input_ids=story, sampling_params=greedy(24, stop_token_ids=[stop]))
    assert r["output_ids"] == plain[:5]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == engine.tokenizer.decode(plain[:4])
    kept = engine.generate_sync(input_ids=story, sampling_params=greedy(24, stop_token_ids=[stop], no_stop_trim=True))
    assert kept["text"] == engine.tokenizer.decode(plain[:5])


def test_stop_strings_are_trimmed_streamed_or_not(engine: Engine) -> None:
    story = chat(engine, STORY)
    text = engine.generate_sync(input_ids=story, sampling_params=greedy(24, ignore_eos=True))["text"]
    words = text.split(" ")
    for stop in (" ".join(words[2:4]), words[5]):  # a multi-token stop string and a one-word one
        prefix = text[: text.find(stop)]
        sp = greedy(24, stop=[stop, "@@never@@"])
        r = engine.generate_sync(input_ids=story, sampling_params=sp)
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert r["text"] == prefix
        deltas = asyncio.run(collect(engine.generate_stream(input_ids=story, sampling_params=sp)))
        assert "".join(d["text"] for d in deltas) == prefix  # no part of the stop string leaks
        assert deltas[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        kept = engine.generate_sync(input_ids=story, sampling_params={**sp, "no_stop_trim": True})
        assert kept["text"].startswith(prefix + stop)


# ---- 6. streaming and abort --------------------------------------------------------------
def test_stream_deltas_concatenate_without_partial_characters(engine: Engine) -> None:
    ids = chat(engine, EMOJI)
    tok = engine.tokenizer
    out = engine.generate_sync(input_ids=ids, sampling_params=greedy(30))["output_ids"]
    # Multi-token characters are in the output, so incomplete UTF-8 really has to be held back.
    assert any("\ufffd" in tok.decode([t]) for t in out)
    # Stop where the output ends on a whole character (a cut character is U+FFFD for good).
    n = max(k for k in range(1, len(out) + 1) if not tok.decode(out[:k]).endswith("\ufffd"))
    assert n >= 15
    whole = engine.generate_sync(input_ids=ids, sampling_params=greedy(n))
    deltas = asyncio.run(collect(engine.generate_stream(input_ids=ids, sampling_params=greedy(n))))
    assert len(deltas) > 3
    assert [d["finished"] for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all("\ufffd" not in d["text"] for d in deltas)
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert sum((d["output_ids"] for d in deltas), []) == whole["output_ids"]
    assert any(ord(c) > 0x2000 for c in whole["text"])


def test_stream_text_decodes_each_step_in_a_window(engine: Engine, monkeypatch) -> None:
    """A stream's text costs O(new tokens) a step: the ids decoded per delta stay within the
    surround window, where decoding the whole output every step decodes ~n^2 / 2 ids in all;
    the text still equals the whole output's decode."""
    decoded: list[int] = []
    inner = engine._text_decoder.batch_decode

    def counting(sequences, skip, spaces):
        decoded.append(sum(len(s) for s in sequences))
        return inner(sequences, skip, spaces)

    monkeypatch.setattr(engine._text_decoder, "batch_decode", counting)
    n = 96
    sp = greedy(n, ignore_eos=True)
    deltas = asyncio.run(collect(engine.generate_stream(input_ids=chat(engine, STORY), sampling_params=sp)))
    ids = sum((d["output_ids"] for d in deltas), [])
    assert len(ids) == n and len(decoded) == len(deltas)
    assert max(decoded) <= 32, decoded  # two windows of a few ids each, never the whole output
    assert sum(decoded) < n * 16 < n * n // 2
    assert "".join(d["text"] for d in deltas) == engine.tokenizer.decode(ids, skip_special_tokens=True)


def _wait_idle(engine: Engine, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        load = engine.get_load()
        if load.num_running_reqs == 0 and load.num_queue_reqs == 0 and load.num_used_tokens == 0:
            return
        assert time.monotonic() < deadline, load
        time.sleep(0.02)


def test_closing_a_stream_aborts_the_request(engine: Engine) -> None:
    long = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 400}

    async def read_three_then_close() -> list[dict[str, Any]]:
        gen = engine.generate_stream(input_ids=chat(engine, STORY), sampling_params=long)
        got = []
        async for d in gen:
            got.append(d)
            if len(got) == 3:
                break
        assert engine.get_load().num_running_reqs == 1
        await gen.aclose()
        return got

    got = asyncio.run(read_three_then_close())
    assert not any(d["finished"] for d in got)
    _wait_idle(engine)


def test_cancelling_a_consumer_aborts_the_request(engine: Engine) -> None:
    long = {"temperature": 0.7, "ignore_eos": True, "max_new_tokens": 400}

    async def cancel_after_three() -> int:
        seen = asyncio.Event()
        count = 0

        async def consume() -> None:
            nonlocal count
            async for _ in engine.generate_stream(input_ids=chat(engine, STORY), sampling_params=long):
                count += 1
                if count == 3:
                    seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return count

    assert asyncio.run(cancel_after_three()) < 400
    _wait_idle(engine)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected crash
def test_requests_after_a_loop_crash_fail_at_once(smollm_path: str) -> None:
    """A crashed loop answers nothing: new requests and control calls fail with 500 right away
    instead of waiting forever."""
    eng = Engine(dtype="float32", model_path=smollm_path, max_total_tokens=1024, load_progress=False)
    try:

        def boom() -> None:
            raise RuntimeError("injected failure")

        eng.scheduler.step = boom  # type: ignore[method-assign]
        deadline = time.monotonic() + 10
        while eng.runtime.crashed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.runtime.crashed is not None
        t0 = time.monotonic()
        with pytest.raises(RequestError, match="scheduler loop crashed") as err:
            eng.generate_sync("Hello", sampling_params={"max_new_tokens": 2})
        assert err.value.status_code == 500 and time.monotonic() - t0 < 5
        with pytest.raises(RequestError, match="scheduler loop crashed"):
            eng.get_load()
    finally:
        eng.shutdown()
