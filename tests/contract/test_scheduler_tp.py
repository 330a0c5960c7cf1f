"""The scheduler service process with --tp-size 2 (CPU, gloo): it serves over gRPC with two
rank processes, drains and exits 0 on SIGTERM leaving no process behind, and its ranks do
not outlive a rank 0 that is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshlm.common.ports import free_port
from meshlm.scheduler.engine import Engine
from meshlm.v1 import common_pb2

from .scheduler_harness import (
    PROMPT,
    RecordingDetokenizer,
    TokenizerStream,
    build_tiny_llama,
    greedy,
    kill_process,
    scheduler_process,
    wait_process_serving,
    wait_until,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_path: str) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp"), smollm_path)


@pytest.fixture
def detok() -> Iterator[RecordingDetokenizer]:
    d = RecordingDetokenizer()
    yield d
    d.kill()


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Whether pid exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _start(model: str, detok: RecordingDetokenizer) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = scheduler_process(
        port,
        "sched-tp",
        model,
        "--tp-size",
        "2",
        "--max-total-tokens",
        "3000",
        "--detokenizer-addrs",
        detok.address,
        "--grace-period-s",
        "30",
    )
    address = f"127.0.0.1:{port}"
    wait_process_serving(proc, address, "the TP scheduler process to serve")
    return proc, address


def _ranks(proc: subprocess.Popen) -> set[int]:
    """The rank processes of the service: interpreters started by multiprocessing's spawn."""
    ranks = set()
    for pid in _descendants(proc.pid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.add(pid)
        except OSError:
            continue
    return ranks


def test_tp2_service_serves_and_exits_cleanly_on_sigterm(tiny_llama: str, detok: RecordingDetokenizer) -> None:
    with Engine(dtype="float32", model_path=tiny_llama, max_total_tokens=3000, load_progress=False) as eng:
        expected = eng.generate_sync(
            input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        )["output_ids"]
    proc, address = _start(tiny_llama, detok)
    tok = None
    try:
        below = _descendants(proc.pid)
        assert len(_ranks(proc)) == 1, f"not one rank process below the service: {below}"
        tok = TokenizerStream(address, "tok-tp")
        load = tok.wait_output(lambda o: o.WhichOneof("msg") == "load").load
        assert load.max_total_num_tokens == 3000
        tok.generate("tp-req", PROMPT, sampling_params=greedy(NEW_TOKENS))
        finish = detok.wait_finish("tp-req")
        assert finish.type == common_pb2.FINISH_TYPE_LENGTH
        assert [i for e in detok.entries("tp-req") for i in e["ids"]] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert wait_until(lambda: not any(_running(p) for p in below), 10, "the service's processes to exit")
    finally:
        if tok is not None:
            tok.cancel()
        kill_process(proc)


def test_tp_ranks_exit_when_rank_0_is_killed(tiny_llama: str, detok: RecordingDetokenizer) -> None:
    proc, _ = _start(tiny_llama, detok)
    try:
        ranks = _ranks(proc)
        assert len(ranks) == 1
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        wait_until(lambda: not any(_running(p) for p in ranks), 15, "the orphaned ranks to exit")
        assert time.monotonic() - t0 < 15
    finally:
        kill_process(proc)
