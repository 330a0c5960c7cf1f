"""Test peers for the scheduler contract tests (real gRPC on loopback, nothing mocked):

* build_tiny_llama: a random 2-layer Llama (hidden 64) with the real SmolLM2 tokenizer, so a
  scheduler starts in about a second and steps in milliseconds on CPU;
* RecordingDetokenizer: a DetokenizerService whose Push records every message (a test peer that
  stands where a detokenizer sits, not a mock of our detokenizer);
* TokenizerStream: one Connect stream driven like a tokenizer replica would;
* ServiceThread: a SchedulerServer running on its own asyncio loop in a thread;
* PROMPT, greedy, engine_config, wait_idle: what the contract tests send and wait for;
* tiny_service: a ServiceThread of the tiny model on a free loopback port;
* scheduler_process: `python -m meshlm.scheduler` on a loopback port (meshlm.common.ports.free_port).
"""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc

from meshlm.common import protocol
from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.service.config import SchedulerServiceConfig
from meshlm.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.serving import serving

T = TypeVar("T")


def build_tiny_llama(out_dir: Path, tokenizer_src: str) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_process_serving(proc: subprocess.Popen[Any], address: str, what: str, timeout: float = 120) -> None:
    """Until the gRPC process at address reports meshlm.v1.SchedulerService SERVING; fails at
    once if the process exits during start-up."""

    def up() -> bool:
        if serving(address, "meshlm.v1.SchedulerService"):
            return True
        assert proc.poll() is None, "the scheduler exited during start-up"
        return False

    wait_until(up, timeout, what, interval=0.2)


class RecordingDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self) -> None:
        self.messages: list[detokenizer_pb2.DetokenizerInput] = []
        self.streams = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Push(self, request_iterator, context):
        with self._lock:
            self.streams += 1
        n = 0
        for msg in request_iterator:
            with self._lock:
                self.messages.append(msg)
            n += 1
        return detokenizer_pb2.PushSummary(messages=n)

    def kill(self) -> None:
        self.server.stop(None)

    def snapshot(self) -> list[detokenizer_pb2.DetokenizerInput]:
        with self._lock:
            return list(self.messages)

    def entries(self, rid: str) -> list[dict[str, Any]]:
        """Every TokenDelta of rid, in arrival order (as dicts; "seeded": its seed is set)."""
        out = []
        for msg in self.snapshot():
            if msg.WhichOneof("msg") != "tokens":
                continue
            b = msg.tokens
            for d in b.deltas:
                if d.rid == rid:
                    out.append(
                        {
                            "scheduler_id": b.scheduler_id,
                            "origin": d.origin,
                            "seeded": d.HasField("seed"),
                            "seed": d.seed,
                            "offset": d.token_offset,
                            "ids": list(d.output_ids),
                            "finish": d.finish_reason,
                            "prompt_tokens": d.prompt_tokens,
                            "completion_tokens": d.completion_tokens,
                            "cached_tokens": d.cached_tokens,
                            "logprobs": d.logprobs,
                            "trace": d.trace,
                        }
                    )
        return out

    def hello(self) -> common_pb2.Hello:
        """The Hello that opened the first Push stream."""
        first = self.snapshot()[0]
        assert first.WhichOneof("msg") == "hello", first
        return first.hello

    def finish(self, rid: str) -> common_pb2.FinishReason | None:
        for e in self.entries(rid):
            if e["finish"].type != common_pb2.FINISH_TYPE_UNSPECIFIED:
                return e["finish"]
        return None

    def wait_finish(self, rid: str, timeout: float = 60.0) -> common_pb2.FinishReason:
        return wait_until(lambda: self.finish(rid), timeout, f"{rid} to finish at the detokenizer", interval=0.05)


class TokenizerStream:
    """A Connect stream: hello first, then whatever the test sends."""

    def __init__(self, address: str, origin: str) -> None:
        self.origin = origin
        self.channel = grpc.insecure_channel(address)
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self._q: queue.Queue[scheduler_pb2.SchedulerInput | None] = queue.Queue()
        self._q.put(scheduler_pb2.SchedulerInput(hello=protocol.hello(origin)))
        self.outputs: list[scheduler_pb2.SchedulerOutput] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self._call = self.stub.Connect(iter(self._q.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for out in self._call:
                with self._lock:
                    self.outputs.append(out)
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended.set()

    def send(self, **kw: Any) -> None:
        self._q.put(scheduler_pb2.SchedulerInput(**kw))

    def generate(self, rid: str, input_ids: list[int], **kw: Any) -> None:
        sp = kw.pop("sampling_params", None) or common_pb2.SamplingParams()
        self.send(
            generate=scheduler_pb2.TokenizedGenerateReqInput(
                rid=rid, origin=self.origin, input_ids=input_ids, sampling_params=sp, **kw
            )
        )

    def snapshot(self) -> list[scheduler_pb2.SchedulerOutput]:
        with self._lock:
            return list(self.outputs)

    def wait_output(
        self, pred: Callable[[scheduler_pb2.SchedulerOutput], bool], timeout: float = 10.0, what: str = "an output"
    ) -> scheduler_pb2.SchedulerOutput:
        return wait_until(lambda: next((o for o in self.snapshot() if pred(o)), None), timeout, what)

    def call(self, call_id: int, timeout: float = 10.0, **kw: Any) -> scheduler_pb2.SchedulerOutput:
        self.send(call_id=call_id, **kw)
        return self.wait_output(lambda o: o.call_id == call_id, timeout, f"reply to call {call_id}")

    def errors(self, rid: str) -> list[scheduler_pb2.RequestError]:
        return [o.error for o in self.snapshot() if o.WhichOneof("msg") == "error" and o.error.rid == rid]

    def half_close(self) -> None:
        self._q.put(None)

    def cancel(self) -> None:
        self._call.cancel()
        self.ended.wait(5)
        self.channel.close()


class ServiceThread:
    """A SchedulerServer on its own event loop (the test talks to it over real gRPC)."""

    def __init__(self, svc: Any, engine: Any) -> None:
        from meshlm.scheduler.service.server import SchedulerServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scheduler-service", daemon=True)
        self.thread.start()
        self.server = SchedulerServer(svc, engine)
        self.port = self.run(self.server.start(), timeout=180)
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 2.0) -> None:
        try:
            self.run(self.server.shutdown(grace_s), timeout=grace_s + 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


SERVICE = "meshlm.v1.SchedulerService"


PROMPT = [504, 2365, 6354, 16438, 27003, 690, 260]  # "The quick brown fox jumps over the"


def greedy(n: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


def engine_config(model: str) -> SchedulerConfig:
    return SchedulerConfig(model_path=model, max_total_tokens=4096, load_progress=False)


def wait_idle(t: TokenizerStream, timeout: float = 2.0, call_base: int = 9000) -> common_pb2.SchedulerLoad:
    """Poll GetLoad over Connect until nothing runs and no KV is held."""
    calls = iter(range(call_base, call_base + 10000))

    def idle():
        load = t.call(next(calls), get_load=scheduler_pb2.GetLoadReq()).load
        return load if load.num_running_reqs == 0 and load.num_queue_reqs == 0 and load.num_used_tokens == 0 else None

    return wait_until(idle, timeout, "the scheduler to be idle with its KV free", interval=0.05)


def scheduler_process(
    port: int, scheduler_id: str, model: str, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m meshlm.scheduler` serving `model` on 127.0.0.1:port (no load progress, warnings
    only), with more flags; env: the process's environment (default: this one's)."""
    argv = [sys.executable, "-m", "meshlm.scheduler", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--scheduler-id", scheduler_id, "--model-path", model, "--no-load-progress", *flags]
    return subprocess.Popen([*argv, "--log-level", "warning"], env=env if env is not None else os.environ.copy())


def tiny_service(model: str, scheduler_id: str, detokenizer_addrs: tuple[str, ...], **config: Any) -> ServiceThread:
    """A scheduler service of `model` (engine_config) on a free loopback port; config: more
    SchedulerServiceConfig fields."""
    svc = SchedulerServiceConfig(
        host="127.0.0.1", port=0, scheduler_id=scheduler_id, detokenizer_addrs=detokenizer_addrs, **config
    )
    return ServiceThread(svc, engine_config(model))


def kill_process(proc: subprocess.Popen) -> None:
    """Kill and reap the process if it still runs."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
