"""Structured output in the engine (SGLang's grammar path): 20 JSON schemas greedy and sampled,
regexes and an EBNF grammar, all in one mixed batch with free requests (which still equal HF's
golden tokens), under chunked prefill and mixed chunk; logprobs of the constrained distribution;
invalid grammars end only their own request; a retracted request continues its grammar; the
llguidance backend across a prefill/decode handover (the decode side continues the matcher)."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import jsonschema
import pytest

from meshlm.scheduler.engine import Engine, RequestError
from tests.structured_schemas import (
    EBNF,
    EBNF_TEXTS,
    MAX_NEW_TOKENS,
    REGEXES,
    SCHEMAS,
    prompt_for,
    schema_text,
)

from .conftest import GOLDEN_NEW_TOKENS, assert_pools_whole

INVALID = {
    "regex": "[a-",
    "json_schema": json.dumps({"type": "foo"}),
    "ebnf": "root ::= missing",
}


def run(engine: Engine, reqs: list[dict[str, Any]]) -> list[dict[str, Any] | BaseException]:
    """Every request at once; a failed request's slot holds its exception."""

    async def go() -> list[dict[str, Any] | BaseException]:
        return list(await asyncio.gather(*(engine.generate(**r) for r in reqs), return_exceptions=True))

    return asyncio.run(go())


def constrained(ids: list[int], field: str, text: str, i: int, sampled: bool) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": MAX_NEW_TOKENS, field: text}
    sp.update({"temperature": 0.8, "sampling_seed": 100 + i} if sampled else {"temperature": 0})
    return {"input_ids": ids, "sampling_params": sp}


def assert_valid(result: Any, field: str, text: str) -> None:
    """A constrained output: finished by its grammar (never by length) and matching it."""
    assert isinstance(result, dict), f"{field}={text!r} failed: {result!r}"
    finish = result["meta_info"]["finish_reason"]
    assert finish["type"] == "stop", f"{field}={text!r} ended by {finish} with {result['text']!r}"
    if field == "json_schema":
        jsonschema.validate(json.loads(result["text"]), json.loads(text))
    elif field == "regex":
        assert re.fullmatch(text, result["text"]), (text, result["text"])
    else:
        assert result["text"] in EBNF_TEXTS, result["text"]


@pytest.fixture(scope="module")
def engine(smollm_path: str):
    # 32-token chunks: the chat prompts (~45 tokens) prefill in two chunks, and the running
    # requests' decode steps ride in those prefill batches (mixed chunk, the default).
    eng = Engine(
        dtype="float32", model_path=smollm_path, max_total_tokens=8192, chunked_prefill_size=32, load_progress=False
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def mixed_run(engine: Engine, golden):
    """One batch: 20 schemas x (greedy, sampled), the regexes, the EBNF (greedy, sampled), a
    regex with logprobs, three invalid grammars and every golden prompt unconstrained."""
    checks: list[tuple[str, str]] = []
    reqs: list[dict[str, Any]] = []
    for i, (what, schema) in enumerate(SCHEMAS):
        ids = engine.apply_chat_template([{"role": "user", "content": prompt_for(what)}])
        for sampled in (False, True):
            reqs.append(constrained(ids, "json_schema", schema_text(schema), i, sampled))
            checks.append(("json_schema", schema_text(schema)))
    ask = engine.apply_chat_template([{"role": "user", "content": "Answer briefly."}])
    for i, rx in enumerate(REGEXES):
        reqs.append(constrained(ask, "regex", rx, i, sampled=False))
        checks.append(("regex", rx))
    for sampled in (False, True):
        reqs.append(constrained(ask, "ebnf", EBNF, 7, sampled))
        checks.append(("ebnf", EBNF))
    n_constrained = len(reqs)
    logprob_req = constrained(ask, "regex", REGEXES[0], 0, sampled=False)
    reqs.append({**logprob_req, "return_logprob": True, "top_logprobs_num": 5})
    for field, text in INVALID.items():
        reqs.append(constrained(ask, field, text, 0, sampled=False))
    free = [
        {"input_ids": g.input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": GOLDEN_NEW_TOKENS}}
        for g in golden
    ]
    results = run(engine, reqs + free)
    k = n_constrained
    return {
        "checks": checks,
        "constrained": results[:k],
        "logprobs": results[k],
        "invalid": results[k + 1 : k + 1 + len(INVALID)],
        "free": results[k + 1 + len(INVALID) :],
    }


def test_twenty_schemas_regexes_and_ebnf_greedy_and_sampled(mixed_run) -> None:
    assert len(mixed_run["constrained"]) == 2 * 20 + len(REGEXES) + 2
    for (field, text), result in zip(mixed_run["checks"], mixed_run["constrained"]):
        assert_valid(result, field, text)


def test_free_requests_beside_constrained_ones_equal_golden(mixed_run, golden) -> None:
    assert [r["output_ids"] for r in mixed_run["free"]] == [g.output_ids for g in golden]


def test_invalid_grammar_fails_alone_with_the_field_named(engine: Engine, mixed_run) -> None:
    for (field, _), err in zip(INVALID.items(), mixed_run["invalid"]):
        assert isinstance(err, RequestError), err
        assert err.status_code == 400
        assert err.message.startswith(f"sampling_params.{field} cannot be compiled (xgrammar)"), err.message
    assert_pools_whole(engine)
    assert engine.get_load().num_grammar_queue_reqs == 0


def test_logprobs_are_those_of_the_constrained_distribution(engine: Engine, mixed_run) -> None:
    """Disallowed tokens have probability 0 (logprob -inf) and the sampled ones carry the
    renormalised mass, as SGLang's sampler reports them after the vocab mask."""
    r = mixed_run["logprobs"]
    assert_valid(r, "regex", REGEXES[0])
    meta = r["meta_info"]
    first_top = meta["output_top_logprobs"][0]
    allowed = [(lp, tok) for lp, tok in first_top if lp > -math.inf]
    assert allowed, first_top
    for _, tok in allowed:  # the first token starts "yes" or "no"
        piece = engine.tokenizer.decode([tok])
        assert "yes".startswith(piece) or "no".startswith(piece), piece
    # Under "(yes|no), [0-9]{3}" the first token has at most a few choices: their mass is ~1.
    assert sum(math.exp(lp) for lp, _ in allowed) > 0.99
    assert all(math.isfinite(lp) for lp, _ in meta["output_token_logprobs"])


def test_compiled_grammars_are_cached_by_key(engine: Engine, mixed_run) -> None:
    pool = engine.scheduler.parts.grammar.pool
    assert pool is not None
    distinct = len({text for _, text in mixed_run["checks"]}) + len(INVALID)
    assert pool.compiles == distinct  # greedy and sampled twins, and the logprob regex, hit
    assert pool.cache_hits >= 20 + 2
    # A bad grammar's failure is cached too: sent again, it fails at once, without a compile.
    with pytest.raises(RequestError, match="sampling_params.regex"):
        engine.generate_sync(input_ids=[1, 2, 3], sampling_params={"regex": INVALID["regex"], "max_new_tokens": 4})
    assert pool.compiles == distinct


def test_retracted_requests_continue_their_grammar(smollm_path: str, golden) -> None:
    """Every request is constrained, and a 320-slot pool forces retractions mid-output: a
    retracted request is prefilled again from prompt + outputs with its matcher as it was
    (it has accepted exactly its output ids) and still ends valid."""
    reqs, checks = [], []
    for i, g in enumerate((golden * 2)[:16]):
        _, schema = SCHEMAS[i % len(SCHEMAS)]
        field, text = ("json_schema", schema_text(schema)) if i % 4 else ("regex", REGEXES[i % len(REGEXES)])
        reqs.append(constrained(g.input_ids, field, text, i, sampled=i % 2 == 1))
        checks.append((field, text))
    with Engine(
        dtype="float32",
        model_path=smollm_path,
        max_total_tokens=320,
        schedule_conservativeness=0.05,
        load_progress=False,
    ) as eng:
        results = run(eng, reqs)
        for (field, text), result in zip(checks, results):
            assert_valid(result, field, text)
        assert eng.scheduler.stats.num_retracted > 0
        assert_pools_whole(eng)


def test_llguidance_across_a_prefill_decode_handover(smollm_path: str) -> None:
    """llguidance on both sides: the prefill side samples the first token under its grammar,
    the decode side builds its own matcher, feeds it that token and continues."""
    common = dict(
        model_path=smollm_path,
        dtype="float32",
        max_total_tokens=4096,
        load_progress=False,
        grammar_backend="llguidance",
    )
    decode = Engine(disaggregation_mode="decode", **common)
    prefill = Engine(disaggregation_mode="prefill", decode_engine=decode, **common)
    try:
        reqs, checks = [], []
        for i, (what, schema) in enumerate(SCHEMAS[:8]):
            ids = prefill.apply_chat_template([{"role": "user", "content": prompt_for(what)}])
            reqs.append(constrained(ids, "json_schema", schema_text(schema), i, sampled=i % 2 == 1))
            checks.append(("json_schema", schema_text(schema)))
        ask = prefill.apply_chat_template([{"role": "user", "content": "Answer briefly."}])
        reqs += [constrained(ask, "regex", REGEXES[1], 0, False), constrained(ask, "ebnf", EBNF, 0, False)]
        checks += [("regex", REGEXES[1]), ("ebnf", EBNF)]
        reqs.append(constrained(ask, "regex", INVALID["regex"], 0, False))
        results = run(prefill, reqs)
        for (field, text), result in zip(checks, results[:-1]):
            assert_valid(result, field, text)
        err = results[-1]
        assert isinstance(err, RequestError) and err.status_code == 400
        assert err.message.startswith("sampling_params.regex cannot be compiled (llguidance)"), err.message
        assert decode.scheduler.stats.generation_tokens > 0  # the outputs were decoded there
        pool = decode.scheduler.parts.grammar.pool
        assert pool is not None and pool.compiles == len(set(t for _, t in checks))
        assert_pools_whole(prefill)
        assert_pools_whole(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
