"""serial_tokenizers keeps HF tokenizers from starting its rayon pool (whose idle threads spin
in sched_yield on the cores the scheduler's OpenMP threads need): a batch decode in a process
that called it starts no thread; without it, the same decode does."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, sys
if sys.argv[2] == "serial":
    from meshlm.common.cpus import serial_tokenizers
    serial_tokenizers()
from tokenizers import Tokenizer
tok = Tokenizer.from_file(os.path.join(sys.argv[1], "tokenizer.json"))
before = len(os.listdir("/proc/self/task"))
ids = [tok.encode("word " * (20 + i)).ids for i in range(64)]
tok.decode_batch(ids)
tok.encode_batch(["some words"] * 64)
print(len(os.listdir("/proc/self/task")) - before)
"""


def _new_threads(path: str, mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, path, mode], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return int(out.stdout.split()[-1])


def test_serial_tokenizers_start_no_pool(smollm_path: str) -> None:
    assert _new_threads(smollm_path, "serial") == 0
    assert _new_threads(smollm_path, "default") > 0  # what the setting prevents


def test_an_explicit_setting_wins(monkeypatch) -> None:
    from meshlm.common.cpus import serial_tokenizers

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    serial_tokenizers()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
