"""OutputTail (meshlm/launch/output_tail.py): a child's output reaches the launcher's stderr
byte for byte, and its last lines are kept for the start-up error."""

from __future__ import annotations

import os
import subprocess
import sys

from meshlm.launch.output_tail import OutputTail

CHILD = r"""
import sys
for i in range(100):
    print(f"line {i}", flush=True)
sys.stderr.write("progress 10%\rprogress 100%\r")
sys.stderr.write("Traceback: ValueError: --model 'x' does not exist\n")
sys.stderr.write("no newline at the end")
sys.exit(3)
"""


def test_output_is_copied_and_its_tail_kept() -> None:
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    tail = OutputTail("child", proc.stdout, out_fd=write_fd)
    tail._thread.start()
    assert proc.wait(timeout=60) == 3
    tail.join(10)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        copied = f.read()
    assert copied.startswith(b"line 0\nline 1\n") and copied.endswith(b"does not exist\nno newline at the end")
    assert copied.count(b"\n") == 101
    assert tail.text(3).splitlines() == [
        "progress 100%",
        "Traceback: ValueError: --model 'x' does not exist",
        "no newline at the end",
    ]
    assert len(tail.text(1000).splitlines()) < 110  # bounded by KEEP_BYTES, most recent kept


def test_the_kept_tail_is_bounded() -> None:
    read_fd, write_fd = os.pipe()
    code = "import sys; sys.stdout.write('x' * 100000 + '\\nlast\\n')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    tail = OutputTail("child", proc.stdout, keep_bytes=1000, out_fd=write_fd)
    tail._thread.start()

    chunks = []
    while True:  # drain our end so the copier never blocks on a full pipe
        data = os.read(read_fd, 65536)
        chunks.append(data)
        if b"last\n" in b"".join(chunks[-2:]):
            break
    proc.wait(timeout=60)
    tail.join(10)
    os.close(write_fd)
    os.close(read_fd)
    assert len(b"".join(chunks)) == 100006
    assert tail.text().endswith("last") and len(tail.text()) <= 1000
