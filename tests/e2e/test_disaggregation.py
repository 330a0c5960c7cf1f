"""Prefill/decode disaggregation end to end: gateway -> tokenizer -> prefill scheduler, which
hands KV + first token over gRPC to a decode scheduler that streams to the detokenizer.
Golden tokens and logprobs through REST, the openai client streaming, cancellation freeing KV
on both schedulers; then the faults (SIGKILL under load, the victim restarted with its argv): a
decode scheduler's streams migrate to the prefill scheduler and end with the uninterrupted
output; a prefill scheduler's end with a clear error; each victim rejoins. The fault tests run
last, in this order."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import httpx
import pytest

from meshlm.launch.launcher import Child, System

from .conftest import http_json, start_system
from .faults import (
    NativeStream,
    greedy_body,
    native_stream,
    scheduler_load,
    wait_idle,
    wait_schedulers_connected,
    wait_until,
)
from .frontend.clients import kill, restart


@pytest.fixture(scope="module")
def pd_system(smollm_path: str) -> Iterator[System]:
    sys_ = start_system(smollm_path, decode_dp_size=1, ready_timeout_s=600)
    yield sys_
    sys_.stop()


def wait_both_idle(system: System, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    loads = []
    while time.monotonic() < deadline:
        loads = [scheduler_load(c.address) for c in system.by_component("scheduler")]
        if all(x.num_running_reqs == 0 and x.num_queue_reqs == 0 and x.num_used_tokens == 0 for x in loads):
            return
        time.sleep(0.1)
    raise AssertionError(f"schedulers not idle within {timeout}s: {loads}")


def decode_child(system: System):
    return next(c for c in system.by_component("scheduler") if c.name.startswith("decode-scheduler"))


def test_rest_greedy_and_logprobs_equal_hf_golden(pd_system: System, golden) -> None:
    body = {
        "input_ids": [g.input_ids for g in golden],
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
        "return_logprob": True,
    }
    status, out = http_json(pd_system.http_url + "/generate", body, timeout=180)
    assert status == 200, out
    assert [o["output_ids"] for o in out] == [g.output_ids for g in golden]
    for g, o in zip(golden, out):
        ours = [row[0] for row in o["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, g.logprobs)) < 1e-3
    wait_both_idle(pd_system)
    decode_load = scheduler_load(decode_child(pd_system).address)
    assert decode_load.max_total_num_tokens > 0


def test_openai_chat_stream(pd_system: System) -> None:
    import openai

    client = openai.OpenAI(base_url=pd_system.http_url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count from 1 to 5."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "1" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 1
    wait_both_idle(pd_system)


def _open_stream(system: System, max_new_tokens: int, events: int):
    """A streaming /generate, returned once `events` SSE data lines have arrived."""
    body = json.dumps(
        {
            "text": "Tell me a very long story about the sea.",
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(system.http_url + "/generate", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    resp = urllib.request.urlopen(req, timeout=60)  # noqa: S310 (loopback)
    lines = 0
    while lines < events:
        if resp.readline().startswith(b"data:"):
            lines += 1
    return resp


def test_client_disconnect_frees_kv_on_both_schedulers(pd_system: System) -> None:
    resp = _open_stream(pd_system, 2000, events=5)
    assert scheduler_load(decode_child(pd_system).address).num_running_reqs == 1
    resp.close()
    wait_both_idle(pd_system, timeout=3.0)


PD_PROMPTS = [f"Request {i}: describe the sea in a few words." for i in range(3)]
PD_TOKENS = 40
DEADLINE_S = 120.0  # generous: the machine is shared; what matters is that nothing hangs


def pd_golden(system: System) -> list[str]:
    status, out = http_json(
        system.http_url + "/generate", {**greedy_body(PD_PROMPTS[0], PD_TOKENS), "text": PD_PROMPTS}
    )
    assert status == 200, out
    return [o["text"] for o in out]


async def _streams_cut_by(system: System, victim: Child) -> list[NativeStream]:
    """PD_PROMPTS as concurrent streams; `victim` is SIGKILLed once each produced a few tokens."""
    async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
        streams = [NativeStream() for _ in PD_PROMPTS]
        tasks = [
            asyncio.create_task(native_stream(c, system.http_url, greedy_body(p, PD_TOKENS), s))
            for p, s in zip(PD_PROMPTS, streams)
        ]
        await wait_until(lambda: all(len(s.texts) >= 3 for s in streams), DEADLINE_S, "every stream's first tokens")
        assert not any(t.done() for t in tasks), "a stream finished before the kill"
        kill(victim)
        return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)


def _rejoined(system: System) -> None:
    """Requests succeed again and reach the decode scheduler (a long stream runs there)."""
    deadline = time.monotonic() + DEADLINE_S
    while (status := http_json(system.http_url + "/generate", greedy_body("Hi", 2))[0]) != 200:
        assert time.monotonic() < deadline, f"no request succeeded after the restart (last status {status})"
        time.sleep(0.5)
    resp = _open_stream(system, 2000, events=3)
    assert scheduler_load(decode_child(system).address).num_running_reqs == 1
    resp.close()
    wait_idle(system.by_component("scheduler"))


def test_decode_scheduler_death_migrates_its_streams_and_it_rejoins(pd_system: System) -> None:
    """The decode scheduler is SIGKILLed mid-stream: each stream migrates to the prefill scheduler
    (it re-prefills prompt + tokens so far and decodes the request itself) and ends with the
    uninterrupted greedy text; the prefill scheduler's KV is all freed; new requests fail with 503
    until the decode scheduler, restarted with the same argv, rejoins."""
    golden = pd_golden(pd_system)
    decode = decode_child(pd_system)
    prefill = next(c for c in pd_system.by_component("scheduler") if c is not decode)
    results = asyncio.run(_streams_cut_by(pd_system, decode))
    for s, want in zip(results, golden):
        assert s.status == 200 and s.done and s.error is None, s.events[-3:]
        assert s.texts[-1] == want
    wait_idle([prefill])
    status, out = http_json(pd_system.http_url + "/generate", greedy_body("Hi", 4))
    assert status == 503 and "no decode scheduler reachable" in json.dumps(out), (status, out)
    restart(decode, 600)
    _rejoined(pd_system)


def test_prefill_scheduler_death_ends_its_requests_with_an_error_and_it_rejoins(pd_system: System) -> None:
    """The (only) prefill scheduler is SIGKILLed mid-stream: its requests, decoding on the decode
    scheduler, end with a clear error (no other scheduler to migrate to), the decode scheduler
    frees their KV, and the prefill scheduler, restarted with the same argv, rejoins."""
    decode = decode_child(pd_system)
    prefill = next(c for c in pd_system.by_component("scheduler") if c is not decode)
    results = asyncio.run(_streams_cut_by(pd_system, prefill))
    for s in results:
        assert s.status == 200 and s.done and s.error is not None and s.error["code"] == 503, s.events[-3:]
        assert "connection lost" in s.error["message"] and "no other scheduler" in s.error["message"], s.error
    wait_idle([decode])
    restart(prefill, 600)
    wait_schedulers_connected(pd_system)
    _rejoined(pd_system)
