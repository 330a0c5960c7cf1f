"""Overload end to end: beyond the limits, new requests are refused at once, and nothing else suffers.

One system (SmolLM2, tiny KV pool) whose scheduler runs at most 2 requests with at most 1 waiting
(`--max-queued-requests 1`, SGLang's flag) and whose tokenizer holds at most 4 requests in flight
(the tokenizer's `--max-queued-requests 4`). Two long greedy streams run, a third waits; then
* a request for one more output passes the tokenizer and is refused by the scheduler (queue full);
* a request for two outputs (n=2 fans out to 2 samples + 1 prefix warm-up) is refused by the
  tokenizer (3 in flight + 3 > 4);
both as HTTP 503 with Retry-After on every route, and RESOURCE_EXHAUSTED naming the limit on the
public gRPC API, while the two long streams are still running (so the refusal did not wait for
capacity or a timeout). The three earlier requests then complete with the same greedy tokens as a
solo run, every KV slot comes back, and new requests succeed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from meshlm.launch.launcher import System
from meshlm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from .conftest import start_system, wait_idle

pytestmark = pytest.mark.timeout(900)

LONG_TOKENS = 512  # the load waits below take ~100-130 tokens here; the streams must outlast them and the checks
PROMPT_A = "Write a long story about a lighthouse keeper and the sea."
PROMPT_B = "List every planet of the solar system and describe each one."


@pytest.fixture(scope="module")
def system(smollm_path: str) -> Iterator[System]:
    sys_ = start_system(
        smollm_path,
        scheduler_args=("--max-total-tokens", "1500", "--max-running-requests", "2", "--max-queued-requests", "1"),
        tokenizer_args=("--max-queued-requests", "4"),
    )
    yield sys_
    sys_.stop()


def http(url: str, body: Any = None, timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback)
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def loads(system: System) -> list[dict]:
    status, _, body = http(system.http_url + "/v1/loads")
    assert status == 200, body
    return json.loads(body)["loads"]


def wait_load(system: System, what: str, pred: Any, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = loads(system)
        if current and pred(current[0]):
            return current[0]
        time.sleep(0.1)
    raise AssertionError(f"no load report showed {what} within {timeout}s: {loads(system)}")


def greedy(prompt: str, n: int = 1) -> tokenizer_pb2.GenerateRequest:
    return tokenizer_pb2.GenerateRequest(
        prompts=[tokenizer_pb2.Prompt(text=prompt)],
        stream=True,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True, n=n),
    )


class LongStream(threading.Thread):
    """One streaming Generate on the public gRPC API, read to its end in a thread."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerServiceStub, prompt: str) -> None:
        super().__init__(daemon=True)
        self.stub, self.prompt = stub, prompt
        self.ids: list[int] = []
        self.finish: common_pb2.FinishReason | None = None
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for response in self.stub.Generate(greedy(self.prompt), timeout=600):
                self.ids.extend(response.output_ids)
                if response.finished:
                    self.finish = response.meta_info.finish_reason
        except grpc.RpcError as e:
            self.error = e


def solo(stub: tokenizer_pb2_grpc.TokenizerServiceStub, prompt: str) -> list[int]:
    return [i for r in stub.Generate(greedy(prompt), timeout=600) for i in r.output_ids]


def check_503(status: int, headers: dict[str, str], body: bytes, *needles: str) -> None:
    assert status == 503, (status, body)
    assert int(headers["retry-after"]) >= 1, headers
    message = json.loads(body)["error"]["message"]
    for needle in needles:
        assert needle in message, message


def test_beyond_the_limits_requests_get_503_at_once_and_the_rest_completes(system: System) -> None:
    channel = grpc.insecure_channel(system.grpc_address)
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
    url = system.http_url
    first = [LongStream(stub, PROMPT_A), LongStream(stub, PROMPT_B)]
    for s in first:
        s.start()
    wait_load(system, "2 running requests", lambda load: load["num_running_reqs"] == 2)
    queued = LongStream(stub, PROMPT_A)
    queued.start()
    wait_load(system, "1 waiting request", lambda load: load["num_waiting_reqs"] == 1)

    # One more output: the tokenizer has room (3 + 1 <= 4), the scheduler's queue has not.
    scheduler_full = ("queue is full", "max_queued_requests=1")
    check_503(*http(url + "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4}}), *scheduler_full)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    check_503(*http(url + "/v1/chat/completions", chat), *scheduler_full)
    check_503(*http(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 4}), *scheduler_full)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(greedy("Hi"), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in err.value.details() and "max_queued_requests=1" in err.value.details()

    # Two more outputs (n=2: two samples and a prefix warm-up): the tokenizer's own limit.
    tokenizer_full = ("too many requests in flight", "max_queued_requests=4")
    check_503(*http(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "n": 2}), *tokenizer_full)
    chat_n2 = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "stream": True}
    check_503(*http(url + "/v1/chat/completions", chat_n2), *tokenizer_full)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(greedy("Hi", n=2), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests=4" in err.value.details()

    # Every refusal came while the first two were still generating: none waited for capacity.
    assert all(s.is_alive() and s.finish is None for s in first), "the long requests ended before the checks"

    for s in [*first, queued]:
        s.join(timeout=600)
        assert s.error is None, s.error
        assert s.finish is not None and s.finish.type == common_pb2.FINISH_TYPE_LENGTH
        assert len(s.ids) == LONG_TOKENS
    wait_idle(system, timeout=30)
    # Afterwards new requests are served, and the earlier ones had the solo run's greedy tokens.
    reference = solo(stub, PROMPT_A)
    assert first[0].ids == reference and queued.ids == reference
    status, _, body = http(url + "/v1/chat/completions", {**chat, "stream": False})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"], body
    wait_idle(system, timeout=30)
    channel.close()
