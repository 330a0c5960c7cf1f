"""Constrained decoding pieces without a model: both grammar backends over SmolLM2's tokenizer
(bitmask, accept, rollback, termination), the bitmask applied to logits, the compile pool's
cache (failures cached too), the grammar queue's refusals, and the gateway's response_format
mapping."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from meshlm.common.finish import FinishReason
from meshlm.scheduler.constrained.backends import create_grammar_backend
from meshlm.scheduler.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammarError
from meshlm.scheduler.constrained.compile_pool import GrammarCompilePool
from meshlm.scheduler.constrained.json_whitespace import JsonWhitespace
from meshlm.scheduler.constrained.vocab_mask import allocate_vocab_mask, apply_vocab_mask, unpack_vocab_mask
from meshlm.scheduler.managers.grammar_manager import GrammarManager
from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.sampling.sampling_params import SamplingParams

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, smollm_tokenizer) -> BaseGrammarBackend:
    return create_grammar_backend(request.param, smollm_tokenizer, VOCAB, [EOS], JsonWhitespace())


def allowed(grammar) -> set[int]:
    mask = allocate_vocab_mask(1, VOCAB)
    grammar.fill_vocab_mask(mask, 0)
    return set(unpack_vocab_mask(mask, VOCAB)[0].nonzero().view(-1).tolist())


def test_matcher_masks_accepts_rolls_back_and_terminates(backend, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    template = backend.compile(("regex", "(yes|no)!"))
    g = template.copy()
    first = allowed(g)
    assert tok.encode("yes")[0] in first and tok.encode("no")[0] in first
    assert EOS not in first and tok.encode("maybe")[0] not in first
    assert not g.accept_token(tok.encode("maybe")[0])  # refused: the state is unchanged
    ids = tok.encode("yes!")
    for t in ids:
        assert g.accept_token(t)
    assert allowed(g) <= {EOS}  # the regex is complete: only the end remains
    g.rollback(1)  # back before "!"
    assert tok.encode("!")[0] in allowed(g)
    assert g.accept_token(ids[-1])
    if not g.is_terminated():  # xgrammar ends on the stop token; llguidance stops by itself
        assert allowed(g) == {EOS} and g.accept_token(EOS)
    assert g.is_terminated()
    assert allowed(template.copy()) == first  # the template was never advanced


def test_json_schema_whitespace_is_bounded(backend, smollm_tokenizer) -> None:
    g = backend.compile(("json", json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}}))).copy()
    newline = smollm_tokenizer.encode("\n")[0]
    assert g.accept_token(smollm_tokenizer.encode("{")[0])
    taken = 0
    while newline in allowed(g) and taken < 10:
        assert g.accept_token(newline)
        taken += 1
    assert taken == JsonWhitespace().max_whitespace


@pytest.mark.parametrize(
    "key, field",
    [(("regex", "[a-"), "regex"), (("json", '{"type": "foo"}'), "json_schema"), (("ebnf", "root ::= missing"), "ebnf")],
)
def test_invalid_grammar_names_its_field(backend, key, field) -> None:
    with pytest.raises(InvalidGrammarError, match=rf"^sampling_params\.{field} cannot be compiled \({backend.name}\)"):
        backend.compile(key)


def test_apply_vocab_mask_only_touches_the_given_rows() -> None:
    logits = torch.zeros(3, 70)
    mask = allocate_vocab_mask(1, 70)
    mask[0] = 0
    mask[0, 0] = 1 << 5  # token 5
    mask[0, 2] = 1 << 1  # token 65
    apply_vocab_mask(logits, mask, [1])
    assert torch.equal(logits[0], torch.zeros(70)) and torch.equal(logits[2], torch.zeros(70))
    finite = torch.isfinite(logits[1]).nonzero().view(-1).tolist()
    assert finite == [5, 65] and logits[1, 6].item() == -math.inf


class CountingBackend(BaseGrammarBackend):
    name = "counting"

    def __init__(self, gate: threading.Event) -> None:
        self.gate, self.calls = gate, 0

    def dispatch_json(self, schema):
        self.gate.wait(10)
        self.calls += 1
        raise InvalidGrammarError("sampling_params.json_schema is not welcome")

    def dispatch_regex(self, regex):
        raise RuntimeError("boom")

    def dispatch_ebnf(self, ebnf):
        raise NotImplementedError


def test_compile_pool_caches_by_key_and_never_blocks() -> None:
    gate, woken = threading.Event(), threading.Event()
    backend = CountingBackend(gate)
    pool = GrammarCompilePool(lambda: backend, threads=1, cache_size=8, on_done=woken.set)
    first = pool.get(("json", "{}"))
    assert not first.done()  # get() returned while the compile waits on the gate
    assert pool.get(("json", "{}")) is first and pool.cache_hits == 1
    gate.set()
    with pytest.raises(InvalidGrammarError):
        first.result(10)
    assert woken.wait(10)
    with pytest.raises(InvalidGrammarError):  # the failure is cached: no second compile
        pool.get(("json", "{}")).result(10)
    assert backend.calls == 1 and pool.compiles == 1
    with pytest.raises(InvalidGrammarError, match=r"^sampling_params\.regex cannot be compiled \(counting\): boom"):
        pool.get(("regex", "x")).result(10)
    pool.shutdown()


class Rejects:
    """An OutputProcessor stand-in that records what the grammar queue ends."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, FinishReason | None]] = []

    def reject(self, req, message, status_code=400):
        req.finished_reason = FinishReason.aborted(message, status_code)
        self.ended.append((req.rid, req.finished_reason))

    def abort(self, req, reason):
        req.finished_reason = reason
        self.ended.append((req.rid, reason))


def test_grammar_queue_refuses_without_a_backend_and_reports_bad_grammars() -> None:
    out = Rejects()
    none = GrammarManager("none", None, out, timeout_s=60)  # type: ignore[arg-type]
    queued: list[Req] = []
    assert not none.process_req_with_grammar(Req("free", [1], SamplingParams()), queued.append)
    assert none.process_req_with_grammar(Req("c", [1], SamplingParams(regex="a")), queued.append)
    assert out.ended[0][1].message.startswith("sampling_params.regex: structured output is disabled")
    gate = threading.Event()
    gate.set()
    pool = GrammarCompilePool(lambda: CountingBackend(gate), threads=1, cache_size=8)
    mgr = GrammarManager("counting", pool, out, timeout_s=60)  # type: ignore[arg-type]
    assert mgr.process_req_with_grammar(Req("bad", [1], SamplingParams(json_schema="{}")), queued.append)
    assert mgr.process_req_with_grammar(Req("gone", [1], SamplingParams(json_schema="{}")), queued.append)
    mgr.abort(lambda rid: rid == "gone", FinishReason.aborted("bye", 499))
    pool.get(("json", "{}")).exception(10)
    mgr.move_ready_grammar_requests()
    assert len(mgr) == 0 and queued == []
    assert [(rid, r.status_code) for rid, r in out.ended[1:]] == [("gone", 499), ("bad", 400)]
    pool.shutdown()


def test_gateway_maps_response_format_as_sglang() -> None:
    from meshlm.gateway.errors import APIError
    from meshlm.gateway.openai_requests import response_format_schema

    assert response_format_schema(None) is None and response_format_schema({"type": "text"}) is None
    assert json.loads(response_format_schema({"type": "json_object"})) == {"type": "object"}
    schema = {"type": "integer"}
    assert (
        json.loads(response_format_schema({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
        == schema
    )
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}, {"type": "xml"}):
        with pytest.raises(APIError) as err:
            response_format_schema(bad)
        assert err.value.status == 400 and err.value.param == "response_format"
