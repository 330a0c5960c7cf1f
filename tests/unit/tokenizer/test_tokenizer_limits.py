"""The size limits of the public gRPC messages (meshlm.tokenizer.limits, numbers from
meshlm.common.input_limits) hold before any prompt is tokenized, and name the field and limit."""

from __future__ import annotations

import pytest

from meshlm.common.input_limits import (
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_TOKEN_IDS_LOGPROB,
    MAX_TOP_LOGPROBS_NUM,
)
from meshlm.tokenizer import limits
from meshlm.tokenizer.request import InvalidRequest, normalize_embed, normalize_generate, tokenize_prompt
from meshlm.v1 import common_pb2, tokenizer_pb2

VOCAB = 49152


class NoTokenizer:
    """Tokenizing anything fails the test: every case here must be rejected before."""

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer was used ({name}) before the limits were checked")


def text(s: str) -> tokenizer_pb2.Prompt:
    return tokenizer_pb2.Prompt(text=s)


CHAT_MANY = tokenizer_pb2.Prompt(
    messages=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user")] * (MAX_MESSAGES + 1))
)
CHAT_LONG_ROLE = tokenizer_pb2.Prompt(
    messages=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="r" * 2000, content="x")])
)


@pytest.mark.parametrize(
    "request_, message",
    [
        (
            tokenizer_pb2.GenerateRequest(prompts=[text("x")] * (MAX_PROMPTS + 1)),
            f"prompts has {MAX_PROMPTS + 1} entries; at most {MAX_PROMPTS} are allowed",
        ),
        (tokenizer_pb2.GenerateRequest(rid="r" * (MAX_ID_CHARS + 1), prompts=[text("x")]), "rid has 257 characters"),
        (
            tokenizer_pb2.GenerateRequest(prompts=[text("x" * (MAX_PROMPT_CHARS + 1))]),
            f"prompts[0].text has {MAX_PROMPT_CHARS + 1} characters; at most {MAX_PROMPT_CHARS}",
        ),
        (
            tokenizer_pb2.GenerateRequest(
                prompts=[tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=[1] * (MAX_PROMPT_TOKENS + 1)))]
            ),
            f"prompts[0].input_ids has {MAX_PROMPT_TOKENS + 1} entries",
        ),
        (tokenizer_pb2.GenerateRequest(prompts=[CHAT_MANY]), f"prompts[0].messages has {MAX_MESSAGES + 1} entries"),
        (tokenizer_pb2.GenerateRequest(prompts=[CHAT_LONG_ROLE]), "prompts[0].messages[0].role has 2000 characters"),
        (
            tokenizer_pb2.GenerateRequest(prompts=[text("x")], top_logprobs_num=MAX_TOP_LOGPROBS_NUM + 1),
            f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS_NUM}, got {MAX_TOP_LOGPROBS_NUM + 1}",
        ),
        (
            tokenizer_pb2.GenerateRequest(prompts=[text("x")], token_ids_logprob=[0] * (MAX_TOKEN_IDS_LOGPROB + 1)),
            f"token_ids_logprob has {MAX_TOKEN_IDS_LOGPROB + 1} entries",
        ),
        (
            tokenizer_pb2.GenerateRequest(prompts=[text("x")], session_id="s" * 300),
            "session_id has 300 characters; at most 256",
        ),
        (
            tokenizer_pb2.GenerateRequest(
                prompts=[text("x")], trace=common_pb2.TraceContext(tracestate="t" * (limits.TRACE_MAX_CHARS + 1))
            ),
            "trace.tracestate has",
        ),
        (
            tokenizer_pb2.GenerateRequest(prompts=[text("x")], sampling_params=common_pb2.SamplingParams(n=129)),
            "sampling_params.n must be in [1, 128], got 129",
        ),
        (
            tokenizer_pb2.GenerateRequest(
                prompts=[text("x")], sampling_params=common_pb2.SamplingParams(stop=["a"] * 65)
            ),
            "sampling_params.stop has 65 strings; at most 64 are allowed",
        ),
    ],
)
def test_generate_limits_before_tokenizing(request_, message):
    with pytest.raises(InvalidRequest) as exc:
        normalize_generate(request_, NoTokenizer(), origin="t", vocab_size=VOCAB)
    assert message in str(exc.value)


def test_embed_tokenize_detokenize_and_ids():
    with pytest.raises(InvalidRequest, match="prompts has 1025 entries"):
        normalize_embed(
            tokenizer_pb2.EmbedRequest(prompts=[text("x")] * 1025), NoTokenizer(), origin="t", vocab_size=VOCAB
        )
    with pytest.raises(InvalidRequest, match=r"prompt\.text has 4194305 characters"):
        tokenize_prompt(NoTokenizer(), text("x" * (MAX_PROMPT_CHARS + 1)), "prompt", VOCAB)
    with pytest.raises(InvalidRequest, match="tokens has 1048577 entries"):
        limits.check_detokenize(tokenizer_pb2.DetokenizeRequest(tokens=[1] * (MAX_PROMPT_TOKENS + 1)))
    with pytest.raises(InvalidRequest, match="session_id has 257 characters"):
        limits.check_id("session_id", "s" * 257)
    limits.check_id("session_id", "s" * 256)
    limits.check_detokenize(tokenizer_pb2.DetokenizeRequest(tokens=[1] * 10))


def test_chat_fields_are_bounded():
    long_args = tokenizer_pb2.ToolCall(id="c1", name="f", arguments="x" * (MAX_PROMPT_CHARS + 1))
    chat = tokenizer_pb2.ChatMessages(
        messages=[tokenizer_pb2.ChatMessage(role="assistant", content="", tool_calls=[long_args])]
    )
    with pytest.raises(InvalidRequest, match=r"prompts\[0\]\.messages\[0\]\.tool_calls\[0\]\.arguments has"):
        limits.check_prompt(tokenizer_pb2.Prompt(messages=chat), "prompts[0]")
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="hi")])
    chat.tools_json = "[" * (MAX_PROMPT_CHARS + 1)
    with pytest.raises(InvalidRequest, match=r"prompt\.tools_json has"):
        limits.check_prompt(tokenizer_pb2.Prompt(messages=chat), "prompt")
