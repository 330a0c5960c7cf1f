"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE) and a small
Llama-style byte-fallback tokenizer: streamed deltas add up to the tokenizer's own decode."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from meshlm.detokenizer.decoder import TokenizerDecoder
from meshlm.detokenizer.incremental import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    Seed,
    TextDelta,
    TokenDelta,
    find_printable_text,
)

IM_START, IM_END = 1, 2


@pytest.fixture(scope="module")
def decoder(smollm_path: str) -> TokenizerDecoder:
    return TokenizerDecoder.from_path(smollm_path)


def encode(decoder: TokenizerDecoder, text: str) -> list[int]:
    return decoder.tokenizer.encode(text, add_special_tokens=False).ids


def stream(
    detok: IncrementalDetokenizer,
    ids: Sequence[int],
    rid: str = "r",
    seed: Seed | None = None,
    chunk: int = 1,
    matched_token: int | None = None,
    matched_str: str | None = None,
) -> list[TextDelta]:
    """Feed `ids` `chunk` at a time (seed on the first step, finish on the last)."""
    seed = seed or Seed()
    out = []
    for k in range(0, max(len(ids), 1), chunk):
        last = k + chunk >= len(ids)
        d = TokenDelta(
            rid,
            ids[k : k + chunk],
            token_offset=k,
            seed=seed if k == 0 else None,
            finished=last,
            matched_token=matched_token if last else None,
            matched_str=matched_str if last else None,
        )
        [r] = detok.step([d])
        assert r is not None and r.error is None, r
        out.append(r)
    return out


def check_stream(deltas: list[TextDelta], trimmed: bool = False) -> str:
    """Offsets add up and unfinished deltas hold no U+FFFD; returns the request's full text.
    Only a final delta that trims a partly streamed stop string (`trimmed`) may move back."""
    sent = ""
    for d in deltas[:-1]:
        assert REPLACEMENT_CHAR not in d.text, deltas
        assert d.text_offset == len(sent)
        sent += d.text
    final = deltas[-1]
    assert final.text_offset <= len(sent) if trimmed else final.text_offset == len(sent)
    return sent[: final.text_offset] + final.text


TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好世界，今天天气很好",
    "🌊🐚🏖️",
    "Café naïve — ünïcödé! 日本語のテキスト 🎉 done.\nNew line",
]


@pytest.mark.parametrize("text", TEXTS, ids=["english", "cjk", "emoji", "mixed"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(decoder, smollm_tokenizer, text: str, chunk: int) -> None:
    ids = encode(decoder, text)
    detok = IncrementalDetokenizer(decoder)
    deltas = stream(detok, ids, chunk=chunk)
    assert check_stream(deltas) == smollm_tokenizer.decode(ids) == text
    assert len(detok) == 0


def test_emoji_bytes_are_held_back_until_complete(decoder) -> None:
    ids = encode(decoder, "🌊🐚")
    assert len(ids) > 2  # each emoji spans several byte tokens
    deltas = stream(IncrementalDetokenizer(decoder), ids)
    assert [d.text for d in deltas if d.text] == ["🌊", "🐚"]


def test_prompt_tail_window(decoder, smollm_tokenizer) -> None:
    prompt, out = encode(decoder, "The sea is"), encode(decoder, " calm and blue today 🌊")
    deltas = stream(IncrementalDetokenizer(decoder), out, seed=Seed(prompt_tail_ids=tuple(prompt[-5:])))
    full, head = smollm_tokenizer.decode(prompt + out), smollm_tokenizer.decode(prompt)
    assert check_stream(deltas) == full[len(head) :] == " calm and blue today 🌊"


def test_unfinished_invalid_bytes_flush_at_finish(decoder, smollm_tokenizer) -> None:
    ids = encode(decoder, "ok ") + encode(decoder, "🌊")[:2]  # ends inside a character
    deltas = stream(IncrementalDetokenizer(decoder), ids)
    assert check_stream(deltas) == smollm_tokenizer.decode(ids)
    assert deltas[-1].text.endswith(REPLACEMENT_CHAR)


def test_stop_string_trimmed_and_no_stop_trim(decoder) -> None:
    ids = encode(decoder, "Hello world. The end")
    text = check_stream(stream(IncrementalDetokenizer(decoder), ids, matched_str=" The end"), trimmed=True)
    assert text == "Hello world."
    seed = Seed(no_stop_trim=True)
    text = check_stream(stream(IncrementalDetokenizer(decoder), ids, seed=seed, matched_str=" The end"))
    assert text == "Hello world. The end"


def test_stop_string_partly_streamed_moves_the_final_offset_back(decoder) -> None:
    ids = encode(decoder, "The answer is 42.\n") + encode(decoder, "\n")  # two newline tokens
    deltas = stream(IncrementalDetokenizer(decoder), ids, matched_str="\n\n")
    sent = "".join(d.text for d in deltas[:-1])
    assert sent == "The answer is 42.\n"  # the first newline went out before the match
    final = deltas[-1]
    assert (final.text_offset, final.text) == (len("The answer is 42."), "")
    assert sent[: final.text_offset] + final.text == "The answer is 42."


def test_matched_stop_token_not_in_text(decoder) -> None:
    ids = encode(decoder, "Hello world.")
    period = ids[-1]
    assert check_stream(stream(IncrementalDetokenizer(decoder), ids, matched_token=period)) == "Hello world"
    kept = stream(IncrementalDetokenizer(decoder), ids, seed=Seed(no_stop_trim=True), matched_token=period)
    assert check_stream(kept) == "Hello world."
    eos = encode(decoder, "Hi there") + [IM_END]
    shown = Seed(skip_special_tokens=False)
    assert check_stream(stream(IncrementalDetokenizer(decoder), eos, seed=shown, matched_token=IM_END)) == "Hi there"
    shown_kept = Seed(skip_special_tokens=False, no_stop_trim=True)
    text = check_stream(stream(IncrementalDetokenizer(decoder), eos, seed=shown_kept, matched_token=IM_END))
    assert text == "Hi there<|im_end|>"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_skip_special_tokens(decoder, smollm_tokenizer, skip: bool, spaces: bool) -> None:
    ids = [IM_START] + encode(decoder, "assistant\nHi there") + [IM_END, IM_START] + encode(decoder, "user")
    seed = Seed(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    text = check_stream(stream(IncrementalDetokenizer(decoder), ids, seed=seed))
    assert text == smollm_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def test_one_step_of_many_requests_decodes_once_per_flag_pair(decoder, smollm_tokenizer) -> None:
    calls: list[tuple[int, bool, bool]] = []

    class Counting:
        def batch_decode(self, seqs, skip, spaces):
            calls.append((len(seqs), skip, spaces))
            return decoder.batch_decode(seqs, skip, spaces)

        def token_texts(self, ids):
            return decoder.token_texts(ids)

    detok = IncrementalDetokenizer(Counting())
    streams = {f"r{i}": [IM_START] + encode(decoder, TEXTS[i % len(TEXTS)]) for i in range(40)}
    seeds = {rid: Seed(skip_special_tokens=i % 2 == 0) for i, rid in enumerate(streams)}
    texts = {rid: "" for rid in streams}
    longest = max(len(v) for v in streams.values())
    for k in range(longest):
        step = [
            TokenDelta(rid, ids[k : k + 1], k, seeds[rid] if k == 0 else None, finished=k == len(ids) - 1)
            for rid, ids in streams.items()
            if k < len(ids)
        ]
        calls.clear()
        for r in detok.step(step):
            assert r is not None and r.text_offset == len(texts[r.rid])
            texts[r.rid] += r.text
        assert len(calls) <= 2 and sorted(c[1] for c in calls) == sorted(
            {seeds[d.rid].skip_special_tokens for d in step}
        )
    for rid, ids in streams.items():
        assert texts[rid] == smollm_tokenizer.decode(ids, skip_special_tokens=seeds[rid].skip_special_tokens)
    assert len(detok) == 0


def test_reseed_resets_state(decoder) -> None:
    ids = encode(decoder, "Hello world, again and again.")
    detok = IncrementalDetokenizer(decoder)
    first = [detok.step([TokenDelta("r", ids[k : k + 1], k, Seed() if k == 0 else None)])[0] for k in range(4)]
    assert sum(len(d.text) for d in first if d) > 0
    [again] = detok.step([TokenDelta("r", ids[:5], 0, Seed())])
    assert again is not None and again.started and again.text_offset == 0 and again.token_offset == 0
    rest = stream_from(detok, ids, 5)
    assert check_stream([again] + rest) == "Hello world, again and again."


def stream_from(detok: IncrementalDetokenizer, ids: list[int], start: int) -> list[TextDelta]:
    out = []
    for k in range(start, len(ids)):
        [r] = detok.step([TokenDelta("r", ids[k : k + 1], k, finished=k == len(ids) - 1)])
        assert r is not None
        out.append(r)
    return out


def test_overlapping_resend_is_clipped(decoder) -> None:
    ids = encode(decoder, "one two three four")
    detok = IncrementalDetokenizer(decoder)
    detok.step([TokenDelta("r", ids[:2], 0, Seed())])
    [r] = detok.step([TokenDelta("r", ids[1:3], 1)])
    assert r is not None and r.token_offset == 2 and list(r.ids) == ids[2:3]
    assert r.text == " three"


def test_token_gap_and_missing_state_fail_the_request_once(decoder) -> None:
    ids = encode(decoder, "one two three four")
    detok = IncrementalDetokenizer(decoder)
    detok.step([TokenDelta("r", ids[:1], 0, Seed())])
    [gap] = detok.step([TokenDelta("r", ids[2:3], 2)])
    assert gap is not None and gap.finished and "skips ids 1..1" in (gap.error or "")
    assert detok.step([TokenDelta("r", ids[3:4], 3)]) == [None]  # later deltas are dropped
    [lost] = detok.step([TokenDelta("other", ids[1:2], 1)])
    assert lost is not None and "no decode state" in (lost.error or "")
    [bad] = detok.step([TokenDelta("neg", [-5], 0, Seed())])
    assert bad is not None and "cannot decode" in (bad.error or "")


def test_first_delta_without_seed_uses_defaults(decoder) -> None:
    [r] = IncrementalDetokenizer(decoder).step([TokenDelta("r", [], 0, finished=True)])
    assert r is not None and r.error is None and r.text == "" and r.finished


def test_lru_evicts_oldest_state(decoder) -> None:
    evicted: list[str] = []
    detok = IncrementalDetokenizer(decoder, max_states=2, on_evict=evicted.append)
    for rid in ("a", "b", "c"):
        detok.step([TokenDelta(rid, encode(decoder, "x"), 0, Seed())])
    assert evicted == ["a"] and "a" not in detok and len(detok) == 2


def test_find_printable_text() -> None:
    assert find_printable_text("Hello wor") == "Hello "
    assert find_printable_text("line\n") == "line\n"
    assert find_printable_text("你好") == "你好"
    assert find_printable_text("你好a") == "你好"
    assert find_printable_text("ab \ufffd") == "ab "
    assert find_printable_text("a \ufffd b ") == "a "


# ---- a Llama-style byte-fallback tokenizer (SentencePiece decoding: ▁ spaces, <0xNN> bytes) ----
WORDS = ["▁Hello", "▁world", "▁Hi", "!", "▁"]


@pytest.fixture(scope="module")
def byte_fallback(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TokenizerDecoder, dict[str, int]]:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    d = Path(tmp_path_factory.mktemp("llama_tok"))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return TokenizerDecoder.from_path(d), vocab


def byte_ids(text: str) -> list[int]:
    return [3 + b for b in text.encode("utf-8")]


def test_byte_fallback_stream(byte_fallback) -> None:
    decoder, v = byte_fallback
    tail = [v["<s>"], v["▁Hi"], v["!"]]
    out = [v["▁Hello"], v["▁"], *byte_ids("🌊"), v["▁world"], v["▁"], *byte_ids("你好"), v["</s>"]]
    deltas = stream(IncrementalDetokenizer(decoder), out, seed=Seed(prompt_tail_ids=tuple(tail)))
    tok = decoder.tokenizer
    full, head = (
        tok.decode(tail + out, skip_special_tokens=True),
        tok.decode(tail, skip_special_tokens=True),
    )
    assert check_stream(deltas) == full[len(head) :] == " Hello 🌊 world 你好"
    # config-declared special tokens are registered: </s> is skipped
    assert tok.decode([v["▁Hi"], v["</s>"]], skip_special_tokens=True) == "Hi"
