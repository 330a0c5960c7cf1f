"""The edge fuzzers (issue 12), shared by tests/e2e/test_fuzz.py (bounded) and bench/fuzz.py (long):

* `fuzz_rest`: schemathesis over the gateway's own OpenAPI document, every operation, positive
  (valid per the document) and negative (invalid) cases over real HTTP; a response of 5xx fails
  (schemathesis' not_a_server_error check);
* `fuzz_grpc`: hypothesis-generated messages for every RPC of the public TokenizerService, sent
  as raw bytes: well-formed messages with values at and past every limit (int32 extremes, NaN /
  inf floats, huge repeated fields), and corrupt ones (invalid UTF-8 in a string field, random
  bytes); a status of INTERNAL, UNKNOWN, UNAVAILABLE or DEADLINE_EXCEEDED fails.

`fuzz_system` starts the services the way the e2e fixtures do, with a short context and a small
fan-out limit so that the valid requests the fuzzers find stay cheap. `greedy_probe` is the
request whose output must be the same before and after a run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from meshlm.common.input_limits import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, MAX_PROMPTS
from meshlm.launch.launcher import System
from meshlm.v1 import common_pb2, tokenizer_pb2

from .conftest import http_json, start_system

# A context of 64 tokens bounds every generation the fuzzers manage to make valid; a fan-out
# limit of 16 (prompts x n) turns the rest into quick INVALID_ARGUMENTs.
FUZZ_SCHEDULER_ARGS = ("--context-length", "64")
FUZZ_TOKENIZER_ARGS = ("--max-queued-requests", "16")
SERVICE = "/meshlm.v1.TokenizerService/"
BAD_CODES = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


def fuzz_system(model: str) -> System:
    return start_system(model, scheduler_args=FUZZ_SCHEDULER_ARGS, tokenizer_args=FUZZ_TOKENIZER_ARGS)


def greedy_probe(system: System) -> dict[str, Any]:
    """A greedy completion (its text and token ids): the same before and after a fuzz run."""
    status, body = http_json(
        system.http_url + "/generate",
        {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
    )
    assert status == 200, body
    return {"text": body["text"], "output_ids": body["output_ids"]}


@dataclass
class Tally:
    """Cases sent and the statuses they got, by operation / RPC."""

    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    # (operation, mode) pairs with no case to generate, e.g. negative cases of a parameterless GET
    unsatisfiable: list[str] = field(default_factory=list)
    seconds: Counter[str] = field(default_factory=Counter)  # time spent per operation / RPC

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())


def _settings(max_examples: int, seed: int | None) -> Callable[[Any], Any]:
    conf = settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=list(HealthCheck),
    )

    def apply(fn: Any) -> Any:
        fn = conf(fn)
        return hypothesis_seed(seed)(fn) if seed is not None else fn

    return apply


# ---------------------------------------------------------------------------- REST


def fuzz_rest(system: System, examples: int, seed: int | None = None, timeout_s: float = 120.0) -> Tally:
    """`examples` positive and `examples` negative cases per operation of /openapi.json."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    base = system.http_url
    http_json(base + "/v1/models")  # the gateway learns the served model name: the document's enum
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    tally = Tally()
    for result in schema.get_all_operations():
        operation = result.ok()
        inputs = len(operation.body) + len(operation.query) + len(operation.path_parameters) + len(operation.headers)
        # An operation without inputs has no invalid case: only its one positive case.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if inputs else (GenerationMode.POSITIVE,)
        for mode in modes:
            _fuzz_operation(operation, mode, base, tally, examples, seed, timeout_s, not_a_server_error)
    return tally


def _fuzz_operation(
    operation: Any, mode: Any, base: str, tally: Tally, examples: int, seed: int | None, timeout_s: float, check: Any
) -> None:
    name = f"{operation.method.upper()} {operation.path}"

    @_settings(examples, seed)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        try:
            response = case.call_and_validate(base_url=base, checks=[check], timeout=timeout_s)
        except Exception as e:
            tally.failures.append(f"{name}: {type(e).__name__}: {str(e)[:2000]}")
            raise
        tally.statuses[f"{name} {response.status_code}"] += 1

    start = time.monotonic()
    try:
        run()
    except Unsatisfiable:
        tally.unsatisfiable.append(f"{name} {mode}")
    finally:
        tally.seconds[name] += time.monotonic() - start


# ---------------------------------------------------------------------------- gRPC

INT32S = st.one_of(
    st.sampled_from([0, 1, -1, 2, 16, 17, 128, 129, 1024, 1025, INT32_MAX, INT32_MIN, 49151, 49152]),
    st.integers(INT32_MIN, INT32_MAX),
)
SMALL_INTS = st.one_of(st.sampled_from([0, 1, 2, -1, INT32_MAX, INT32_MIN]), st.integers(-4, 64))
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, -2.0, 1e-7, 1e38, -1e38, 3.5e38]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
TEXTS = st.one_of(st.text(max_size=40), st.sampled_from(["", "Hi", "\x00", "\ufffd" * 3, "x" * 5000]))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), INT32S), max_size=40)


def _optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams()
    for name in ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval"):
        value = draw(_optional(SMALL_INTS if name in ("max_new_tokens", "n") else INT32S))
        if value is not None:
            setattr(sp, name, value)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = draw(_optional(FLOATS))
        if value is not None:
            setattr(sp, name, value)
    seed = draw(_optional(st.integers(INT64_MIN, INT64_MAX)))
    if seed is not None:
        sp.sampling_seed = seed
    sp.stop.extend(draw(st.one_of(st.lists(TEXTS, max_size=4), st.just(["s"] * 70))))
    sp.stop_token_ids.extend(draw(st.one_of(TOKEN_IDS, st.just(list(range(1100))))))
    for key, value in draw(st.dictionaries(INT32S, FLOATS, max_size=4)).items():
        sp.logit_bias[key] = value
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        value = draw(_optional(st.booleans()))
        if value is not None:
            setattr(sp, name, value)
    for name in ("json_schema", "regex", "ebnf"):
        if draw(st.integers(0, 9)) == 0:
            setattr(sp, name, draw(TEXTS))
    return sp


@st.composite
def prompt(draw: st.DrawFn) -> tokenizer_pb2.Prompt:
    kind = draw(st.sampled_from(["text", "input_ids", "messages", "none"]))
    if kind == "text":
        return tokenizer_pb2.Prompt(text=draw(TEXTS))
    if kind == "input_ids":
        return tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=draw(TOKEN_IDS)))
    if kind == "messages":
        role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXTS)
        messages = [
            tokenizer_pb2.ChatMessage(role=draw(role), content=draw(TEXTS)) for _ in range(draw(st.integers(0, 3)))
        ]
        chat = tokenizer_pb2.ChatMessages(messages=messages)
        add = draw(_optional(st.booleans()))
        if add is not None:
            chat.add_generation_prompt = add
        return tokenizer_pb2.Prompt(messages=chat)
    return tokenizer_pb2.Prompt()


PROMPTS = st.one_of(
    st.lists(prompt(), max_size=3),
    st.just([tokenizer_pb2.Prompt(text="x")] * (MAX_PROMPTS + 1)),
    st.just([tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=[1] * 2_000_000))]),
)


@st.composite
def generate_request(draw: st.DrawFn) -> tokenizer_pb2.GenerateRequest:
    req = tokenizer_pb2.GenerateRequest(
        rid=draw(st.one_of(st.just(""), TEXTS)),
        prompts=draw(PROMPTS),
        sampling_params=draw(sampling_params()),
        return_logprob=draw(st.booleans()),
        top_logprobs_num=draw(SMALL_INTS),
        token_ids_logprob=draw(st.one_of(TOKEN_IDS, st.just([0] * 1100))),
        stream=draw(st.booleans()),
        return_text_in_logprobs=draw(st.booleans()),
        session_id=draw(st.one_of(st.just(""), TEXTS)),
        session_rid=draw(st.one_of(st.just(""), TEXTS)),
        trace=common_pb2.TraceContext(traceparent=draw(TEXTS), tracestate=draw(TEXTS)),
    )
    start = draw(_optional(INT32S))
    if start is not None:
        req.logprob_start_len = start
    return req


@st.composite
def plausible_generate_request(draw: st.DrawFn) -> tokenizer_pb2.GenerateRequest:
    """A request that is mostly valid (so Generate also runs to its end), with one field or two off."""
    texts = st.sampled_from(["Hi", "The capital of France is", "1 2 3", "\u00e9t\u00e9 \U0001f600"])
    one = st.one_of(
        texts.map(lambda t: tokenizer_pb2.Prompt(text=t)),
        st.lists(st.integers(0, 49151), min_size=1, max_size=8).map(
            lambda ids: tokenizer_pb2.Prompt(input_ids=tokenizer_pb2.TokenIdList(ids=ids))
        ),
        texts.map(
            lambda t: tokenizer_pb2.Prompt(
                messages=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=t)])
            )
        ),
    )
    sp = common_pb2.SamplingParams(max_new_tokens=draw(st.integers(0, 4)), temperature=draw(st.floats(0, 1.5)))
    if draw(st.booleans()):
        sp.top_k = draw(st.sampled_from([-1, 1, 5, 50]))
    if draw(st.booleans()):
        sp.top_p = draw(st.floats(0.05, 1))
    if draw(st.booleans()):
        sp.n = draw(st.integers(1, 3))
    if draw(st.booleans()):
        sp.stop.extend(draw(st.lists(st.sampled_from([".", "\n", "is"]), max_size=2)))
    if draw(st.booleans()):
        sp.logit_bias[draw(st.integers(0, 49151))] = draw(st.floats(-5, 5))
    req = tokenizer_pb2.GenerateRequest(
        prompts=draw(st.lists(one, min_size=1, max_size=2)),
        sampling_params=sp,
        return_logprob=draw(st.booleans()),
        top_logprobs_num=draw(st.integers(0, 3)),
        stream=draw(st.booleans()),
        return_text_in_logprobs=draw(st.booleans()),
    )
    off = draw(
        st.sampled_from(
            ["", "", "", "", "top_logprobs_num", "min_new_tokens", "token_ids_logprob", "logprob_start_len"]
        )
    )
    if off == "top_logprobs_num":
        req.top_logprobs_num = draw(st.sampled_from([-1, 49153, INT32_MAX]))
    elif off == "min_new_tokens":
        req.sampling_params.min_new_tokens = draw(st.sampled_from([5, INT32_MAX]))
    elif off == "token_ids_logprob":
        req.token_ids_logprob.extend(draw(st.lists(st.sampled_from([0, 1, 49151, 49152, -1]), max_size=3)))
    elif off == "logprob_start_len":
        req.logprob_start_len = draw(st.sampled_from([-2, -1, 0, 1, 100]))
    return req


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def _flip(raw: bytes, at: int, mask: int) -> bytes:
    if not raw:
        return raw
    at %= len(raw)
    return raw[:at] + bytes([raw[at] ^ mask]) + raw[at + 1 :]


def _corrupt(message: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Serialized messages, sometimes corrupted: a string field 1 of invalid UTF-8, random bytes,
    a cut or a flipped byte."""
    raw = message.map(_serialize)
    bad_utf8 = st.binary(min_size=1, max_size=8).map(lambda b: b"\x0a" + bytes([len(b) + 1]) + b"\xff" + b)
    flipped = st.builds(_flip, raw, st.integers(0, 1 << 16), st.integers(1, 255))
    cut = raw.map(lambda b: b[: len(b) // 2])
    return st.one_of(raw, raw, raw, bad_utf8, flipped, cut, st.binary(max_size=64))


# Each RPC: (method, streaming response, strategy of request bytes).
RPCS: list[tuple[str, bool, st.SearchStrategy[bytes]]] = [
    ("Generate", True, st.one_of(_corrupt(generate_request()), plausible_generate_request().map(_serialize))),
    ("Embed", False, _corrupt(st.builds(tokenizer_pb2.EmbedRequest, rid=TEXTS, prompts=PROMPTS))),
    (
        "Tokenize",
        False,
        _corrupt(st.builds(tokenizer_pb2.TokenizeRequest, prompt=prompt(), add_special_tokens=st.booleans())),
    ),
    (
        "Detokenize",
        False,
        _corrupt(
            st.builds(
                tokenizer_pb2.DetokenizeRequest,
                tokens=st.one_of(TOKEN_IDS, st.just([5] * 2_000_000)),
                skip_special_tokens=st.booleans(),
            )
        ),
    ),
    ("Abort", False, _corrupt(st.builds(tokenizer_pb2.AbortRequest, rid=TEXTS, abort_all=st.just(False)))),
    (
        "OpenSession",
        False,
        _corrupt(st.builds(tokenizer_pb2.OpenSessionRequest, capacity_of_str_len=INT32S, session_id=TEXTS)),
    ),
    ("CloseSession", False, _corrupt(st.builds(tokenizer_pb2.CloseSessionRequest, session_id=TEXTS))),
    ("GetModelInfo", False, _corrupt(st.just(common_pb2.GetModelInfoRequest()))),
    ("GetServerInfo", False, _corrupt(st.just(tokenizer_pb2.GetServerInfoRequest()))),
    ("FlushCache", False, _corrupt(st.just(tokenizer_pb2.FlushCacheRequest()))),
]


def _identity(raw: bytes) -> bytes:
    return raw


def send_raw(
    channel: grpc.Channel, method: str, streaming: bool, raw: bytes, timeout_s: float
) -> tuple[grpc.StatusCode, str]:
    """Call SERVICE/method with the request bytes as they are; (status code, details)."""
    try:
        if streaming:
            for _ in channel.unary_stream(SERVICE + method, _identity, _identity)(raw, timeout=timeout_s):
                pass
        else:
            channel.unary_unary(SERVICE + method, _identity, _identity)(raw, timeout=timeout_s)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def fuzz_grpc(system: System, examples: int, seed: int | None = None, timeout_s: float = 60.0) -> Tally:
    """`examples` cases per RPC of the public TokenizerService."""
    tally = Tally()
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(system.grpc_address, options=options) as channel:
        for method, streaming, requests in RPCS:
            _fuzz_rpc(channel, method, streaming, requests, tally, examples, seed, timeout_s)
    return tally


def _fuzz_rpc(
    channel: grpc.Channel,
    method: str,
    streaming: bool,
    requests: st.SearchStrategy[bytes],
    tally: Tally,
    examples: int,
    seed: int | None,
    timeout_s: float,
) -> None:
    @_settings(examples, seed)
    @given(raw=requests)
    def run(raw: bytes) -> None:
        code, details = send_raw(channel, method, streaming, raw, timeout_s)
        tally.statuses[f"{method} {code.name}"] += 1
        if code in BAD_CODES:
            failure = f"{method}: {code.name} {details[:500]} for {raw[:200]!r}"
            tally.failures.append(failure)
            raise AssertionError(failure)

    start = time.monotonic()
    try:
        run()
    finally:
        tally.seconds[method] += time.monotonic() - start


def wait_answering(system: System, timeout_s: float = 60.0) -> None:
    """/health_generate answers 200 (the system serves again) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    status = 0
    while time.monotonic() < deadline:
        status, _ = http_json(system.http_url + "/health_generate")
        if status == 200:
            return
        time.sleep(0.5)
    raise AssertionError(f"/health_generate answers {status} after the fuzz run")
