"""Request normalisation (batch, n>1, rids, indices), validation messages, delta dedup."""

from __future__ import annotations

import pytest

from meshlm.tokenizer.hf_tokenizer import HFTokenizer
from meshlm.tokenizer.request import (
    DeltaTracker,
    InvalidRequest,
    normalize_embed,
    normalize_generate,
)
from meshlm.v1 import common_pb2, tokenizer_pb2

VOCAB = 49152


@pytest.fixture(scope="module")
def tok(smollm_path: str) -> HFTokenizer:
    return HFTokenizer(smollm_path)


def text(s: str) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(text=s)


def ids(*values: int) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=list(values)))


def chat(*turns: tuple[str, str], add_generation_prompt=None) -> tokenizer_pb2.Prompt:
    msgs = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    if add_generation_prompt is not None:
        msgs.add_generation_prompt = add_generation_prompt
    return tokenizer_pb2.Prompt(messages=msgs)


def gen(*prompts, **kw) -> tokenizer_pb2.GenerateRequest:
    sp = kw.pop("sampling_params", None)
    req = tokenizer_pb2.GenerateRequest(prompts=list(prompts), **kw)
    if sp is not None:
        req.sampling_params.CopyFrom(sp)
    return req


def norm(tok, req, **kw):
    return normalize_generate(req, tok, origin="tok-0", vocab_size=VOCAB, **kw)


def test_single_prompt_keeps_rid_and_index(tok):
    out = norm(tok, gen(text("Hello there"), rid="abc"))
    assert [(s.index, s.rid) for s in out.subs] == [(0, "abc")]
    req = out.subs[0].req
    assert req.rid == "abc" and req.origin == "tok-0"
    assert list(req.input_ids) == tok.encode("Hello there") and req.input_text == "Hello there"
    assert req.logprob_start_len == -1 and req.stream is True and req.created_time > 0
    assert out.warmups == []


def test_generated_rid_is_uuid_hex(tok):
    out = norm(tok, gen(text("x")))
    assert len(out.rid) == 32 and out.subs[0].rid == out.rid


def test_batch_and_n_indices_and_rids(tok):
    sp = common_pb2.SamplingParams(n=3, temperature=0.7, max_new_tokens=5)
    out = norm(tok, gen(text("a"), ids(1, 2, 3), chat(("user", "hi")), rid="r", sampling_params=sp))
    assert out.n == 3
    assert [s.index for s in out.subs] == list(range(9))
    assert [s.rid for s in out.subs] == [f"r_{i}" for i in range(9)]
    assert [s.prompt_index for s in out.subs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # index = prompt_index * n + sample_index, each copy is one sample with the request's params
    for s in out.subs:
        assert s.index // 3 == s.prompt_index
        assert not s.req.sampling_params.HasField("n")
        assert s.req.sampling_params.max_new_tokens == 5
        assert s.req.sampling_params.temperature == pytest.approx(0.7)
    assert list(out.subs[3].req.input_ids) == [1, 2, 3]
    # n>1: one prefix-cache warm-up per prompt, max_new_tokens=0, rid prefixed by the request's
    assert [(w.prompt_index, w.rid) for w in out.warmups] == [
        (0, "r_warmup_0"),
        (1, "r_warmup_1"),
        (2, "r_warmup_2"),
    ]
    for w in out.warmups:
        assert w.req.sampling_params.max_new_tokens == 0 and not w.req.return_logprob
        assert list(w.req.input_ids) == list(out.subs[w.prompt_index * 3].req.input_ids)
    assert norm(tok, gen(text("a"), rid="r", sampling_params=sp), warmup=False).warmups == []


def test_batch_without_n_uses_prompt_index(tok):
    out = norm(tok, gen(text("a"), text("b"), rid="q"))
    assert [(s.index, s.rid) for s in out.subs] == [(0, "q_0"), (1, "q_1")]


def test_chat_prompt_renders_template(tok):
    out = norm(tok, gen(chat(("system", "Be brief."), ("user", "Hi"))))
    want_text, want_ids = tok.chat_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out.subs[0].req.input_text == want_text and list(out.subs[0].req.input_ids) == want_ids
    assert want_text.endswith("<|im_start|>assistant\n")  # add_generation_prompt defaults to true
    no_gen = norm(tok, gen(chat(("user", "Hi"), add_generation_prompt=False)))
    assert not no_gen.subs[0].req.input_text.endswith("assistant\n")


def test_logprob_and_trace_fields_are_copied(tok):
    trace = common_pb2.TraceContext(traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    req = gen(
        ids(5, 6, 7, 8),
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=2,
        token_ids_logprob=[3, 4],
        session_id="s0-x",
        session_rid="prev",
    )
    out = norm(tok, req, trace=trace)
    r = out.subs[0].req
    assert (r.return_logprob, r.logprob_start_len, r.top_logprobs_num) == (True, 1, 2)
    assert list(r.token_ids_logprob) == [3, 4] and r.has_token_ids_logprob
    assert (r.session_id, r.session_rid) == ("s0-x", "prev")
    assert r.trace.traceparent == trace.traceparent


def test_embed_normalisation(tok):
    rid, items = normalize_embed(
        tokenizer_pb2.EmbedRequest(prompts=[text("a b"), ids(1, 2)], rid="e"),
        tok,
        origin="o",
        vocab_size=VOCAB,
    )
    assert rid == "e" and [(i, r) for i, r, _ in items] == [(0, "e_0"), (1, "e_1")]
    assert list(items[1][2].input_ids) == [1, 2] and items[0][2].origin == "o"


@pytest.mark.parametrize(
    "request_,field",
    [
        (gen(), "prompts is empty"),
        (gen(tokenizer_pb2.Prompt()), "prompts[0]: set exactly one of text, input_ids, messages"),
        (gen(text("")), "prompts[0].text is empty"),
        (gen(text("ok"), ids()), "prompts[1].input_ids is empty"),
        (
            gen(ids(1, VOCAB)),
            f"prompts[0].input_ids[1] = {VOCAB} is out of the vocabulary; token ids must be in [0, {VOCAB})",
        ),
        (gen(ids(-1)), "prompts[0].input_ids[0] = -1"),
        (
            gen(tokenizer_pb2.Prompt(messages=tokenizer_pb2.ChatMessages())),
            "prompts[0].messages is empty",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(n=0)),
            "sampling_params.n must be in [1, 128], got 0",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(temperature=-1)),
            "sampling_params.temperature",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(top_p=0)),
            "sampling_params.top_p must be in (0, 1]",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(top_k=0)),
            "sampling_params.top_k must be -1",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(min_p=1.5)),
            "sampling_params.min_p must be in [0, 1]",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(presence_penalty=3)),
            "sampling_params.presence_penalty must be in [-2, 2]",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(repetition_penalty=0)),
            "sampling_params.repetition_penalty must be in (0, 2]",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(max_new_tokens=-1)),
            "sampling_params.max_new_tokens must be in [0, 2147483647]",
        ),
        (
            gen(
                text("x"),
                sampling_params=common_pb2.SamplingParams(min_new_tokens=5, max_new_tokens=2),
            ),
            "sampling_params.min_new_tokens (5) must be <= max_new_tokens (2)",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(json_schema="{bad")),
            "sampling_params.json_schema is not valid JSON",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(logit_bias={VOCAB + 5: 1.0})),
            "sampling_params.logit_bias key",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(stop=[""])),
            "sampling_params.stop[0] is empty",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(stop_token_ids=[1, VOCAB])),
            f"sampling_params.stop_token_ids[1] = {VOCAB} is out of the vocabulary",
        ),
        (
            gen(text("x"), sampling_params=common_pb2.SamplingParams(logit_bias={5: float("inf")})),
            "sampling_params.logit_bias[5] must be a finite number, got inf",
        ),
        (gen(text("x"), top_logprobs_num=-2), "top_logprobs_num must be >= 0, got -2"),
        (
            gen(text("x"), token_ids_logprob=[VOCAB]),
            f"token_ids_logprob[0] = {VOCAB} is out of the vocabulary",
        ),
        (
            gen(ids(1, 2), return_logprob=True, logprob_start_len=2),
            "logprob_start_len (2) must be < the number of prompt tokens (2)",
        ),
        (gen(text("x"), logprob_start_len=-5), "logprob_start_len must be >= -1"),
        (
            gen(text("x"), session_id="s0-a", sampling_params=common_pb2.SamplingParams(n=2)),
            "sampling_params.n must be 1 in a session",
        ),
        (gen(text("x"), session_rid="a"), "session_rid needs session_id"),
    ],
)
def test_validation_errors_name_the_field(tok, request_, field):
    with pytest.raises(InvalidRequest) as exc:
        norm(tok, request_)
    assert field in str(exc.value)


def test_max_input_len_is_enforced(tok):
    with pytest.raises(
        InvalidRequest, match=r"prompts\[0\] has 4 tokens, longer than the model's context length allows \(3 input"
    ):
        norm(tok, gen(ids(1, 2, 3, 4)), max_input_len=3)
    norm(tok, gen(ids(1, 2, 3)), max_input_len=3)


def test_delta_tracker_drops_and_clips_overlaps():
    t = DeltaTracker()
    assert t.clip_text("Hello", 0) == "Hello"
    assert t.clip_text(" wor", 5) == " wor"
    assert t.clip_text("Hello wor", 0) == ""  # a resend of what we have
    assert t.clip_text("lo world", 3) == "ld"  # overlap: only the new tail
    assert t.chars == 11
    assert t.clip_text("", 11) == ""
    assert t.clip_ids([1, 2, 3], 0) == ([1, 2, 3], 0)
    assert t.clip_ids([1, 2, 3], 0) == ([], 3)  # resend: dropped
    assert t.clip_ids([2, 3, 4, 5], 1) == ([4, 5], 2)  # resync from an offset: clipped
    assert t.clip_ids([6], 5) == ([6], 0)
    assert t.ids == 6
