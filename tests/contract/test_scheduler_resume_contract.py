"""Contract of a migrated request at the scheduler (TokenizedGenerateReqInput.resumed, protocol 3):
the scheduler continues from the outputs a lost scheduler produced, so the ids equal an
uninterrupted run (greedy, and seeded sampling with a frequency penalty, which counts the resumed
ids), its first TokenDelta carries the seed and every id from token offset 0 (the detokenizer
decodes the text from the start), logprobs stay aligned with the ids, and a bad resume is
rejected naming the field. The tiny random Llama of test_scheduler_contract.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshlm.v1 import common_pb2, scheduler_pb2

from .scheduler_harness import (
    PROMPT,
    RecordingDetokenizer,
    ServiceThread,
    TokenizerStream,
    build_tiny_llama,
    greedy,
    tiny_service,
    wait_idle,
)

N, K = 20, 7  # output length; tokens produced before the first scheduler was lost


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_path: str) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm_path)


@pytest.fixture(scope="module")
def detok() -> Iterator[RecordingDetokenizer]:
    d = RecordingDetokenizer()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def tok(tiny_llama: str, detok: RecordingDetokenizer) -> Iterator[TokenizerStream]:
    service: ServiceThread = tiny_service(tiny_llama, "sched-resume", (detok.address,))
    t = TokenizerStream(service.address, "tok-resume")
    yield t
    t.cancel()
    service.stop()


def run(tok: TokenizerStream, detok: RecordingDetokenizer, rid: str, sp: common_pb2.SamplingParams, **kw) -> list:
    tok.generate(rid, PROMPT, sampling_params=sp, stream=True, **kw)
    detok.wait_finish(rid)
    return detok.entries(rid)


def ids_of(entries: list) -> list[int]:
    return [i for e in entries for i in e["ids"]]


def test_a_resumed_request_continues_with_the_same_ids_logprobs_and_a_seeded_restart(
    tok: TokenizerStream, detok: RecordingDetokenizer
) -> None:
    lp = {"return_logprob": True, "top_logprobs_num": 2}
    whole = run(tok, detok, "whole", greedy(N), **lp)
    ids = ids_of(whole)
    out_lp = [t for e in whole for t in e["logprobs"].output_token_logprobs]
    tops = [row for e in whole for row in e["logprobs"].output_top_logprobs]
    assert len(ids) == len(out_lp) == len(tops) == N

    resumed = scheduler_pb2.ResumedOutput(output_ids=ids[:K], cached_tokens=3)
    resumed.logprobs.output_token_logprobs.extend(out_lp[:K])
    resumed.logprobs.output_top_logprobs.extend(tops[:K])
    moved = run(tok, detok, "whole_m1", greedy(N), resumed=resumed, **lp)

    first = moved[0]
    assert first["seeded"] and list(first["seed"].prompt_tail_ids) == PROMPT[-5:] and first["seed"].want_logprob_text
    assert first["offset"] == 0 and first["ids"][:K] == ids[:K] and len(first["ids"]) > K
    offset = 0
    for e in moved:  # one contiguous stream from offset 0
        assert e["offset"] == offset
        offset += len(e["ids"])
    assert not any(e["seeded"] for e in moved[1:])
    assert ids_of(moved) == ids
    last = moved[-1]
    assert last["finish"].type == common_pb2.FINISH_TYPE_LENGTH and last["completion_tokens"] == N
    assert last["prompt_tokens"] == len(PROMPT) and all(e["cached_tokens"] == 3 for e in moved)
    # Output logprob k is about output id k: the resumed ones as given, the new ones as computed.
    moved_lp = [t for e in moved for t in e["logprobs"].output_token_logprobs]
    assert [t.token_id for t in moved_lp] == ids
    assert moved_lp[:K] == out_lp[:K]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(moved_lp[K:], out_lp[K:])) < 1e-3
    assert len([row for e in moved for row in e["logprobs"].output_top_logprobs]) == N
    assert not any(e["logprobs"].input_token_logprobs for e in moved)  # the client has the prompt's
    wait_idle(tok)


def test_seeded_sampling_and_penalties_count_the_resumed_ids(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    sp = common_pb2.SamplingParams(
        temperature=1.0, sampling_seed=11, frequency_penalty=1.5, max_new_tokens=N, ignore_eos=True
    )
    ids = ids_of(run(tok, detok, "seeded", sp))
    moved = run(tok, detok, "seeded_m1", sp, resumed=scheduler_pb2.ResumedOutput(output_ids=ids[:K]))
    assert ids_of(moved) == ids
    wait_idle(tok)


def test_a_bad_resume_is_rejected_naming_the_field(tok: TokenizerStream, detok: RecordingDetokenizer) -> None:
    cases = {
        "r-vocab": (greedy(8), scheduler_pb2.ResumedOutput(output_ids=[49152 + 3]), {}, "resumed.output_ids"),
        "r-long": (greedy(4), scheduler_pb2.ResumedOutput(output_ids=PROMPT[:4]), {}, "max_new_tokens"),
        "r-lp": (greedy(8), scheduler_pb2.ResumedOutput(output_ids=PROMPT[:2]), {"return_logprob": True}, "logprobs"),
    }
    for rid, (sp, resumed, kw, _) in cases.items():
        tok.generate(rid, PROMPT, sampling_params=sp, resumed=resumed, **kw)
    for rid, (_, _, _, field) in cases.items():
        f = detok.wait_finish(rid)
        assert f.type == common_pb2.FINISH_TYPE_ABORT and f.status_code == 400 and field in f.message, f
    wait_idle(tok)
