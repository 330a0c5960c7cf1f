"""OutputTail: a child process's output, copied to the launcher's stderr, last lines kept.

`meshlm launch` starts every service at once, so their logs interleave; when one dies during
start-up the launcher names it and quotes the end of its own output (`text()`), which would be
hard to pick out of the interleaved console. The child's stdout and stderr go to one pipe; a
daemon thread copies what arrives to file descriptor 2 of the launcher, cut after the last line
end of each read (a log record is not split between two services' output; tqdm's `\\r`
counts as a line end), and keeps the last `keep_bytes` of it. The thread ends at EOF, when the
child exits.

Invariants: every byte the child writes reaches fd 2 once, in order; `text()` is safe from any
thread; `join()` returns once everything the child wrote before exiting has been copied.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import IO

KEEP_BYTES = 8192
TAIL_LINES = 40
_READ_BYTES = 65536


class OutputTail:
    def __init__(
        self, name: str, pipe: IO[bytes], keep_bytes: int = KEEP_BYTES, out_fd: int = 2, pid: int | None = None
    ) -> None:
        self.name = name
        self.pid = pid  # the process whose output this is (a restarted child is another one)
        self._pipe = pipe
        self._keep = keep_bytes
        self._out_fd = out_fd
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name=f"output-{name}", daemon=True)

    @classmethod
    def start(cls, name: str, pipe: IO[bytes] | None, pid: int | None = None) -> OutputTail:
        if pipe is None:
            raise ValueError(f"{name}: the child's stdout must be a pipe")
        tail = cls(name, pipe, pid=pid)
        tail._thread.start()
        return tail

    def _emit(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the launcher's stderr is gone: keep draining
            os.write(self._out_fd, data)
        with self._lock:
            self._tail += data
            del self._tail[: max(0, len(self._tail) - self._keep)]

    def _copy(self) -> None:
        fd = self._pipe.fileno()
        pending = b""
        try:
            while True:
                chunk = os.read(fd, _READ_BYTES)
                if not chunk:
                    break
                pending += chunk
                cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
                if cut == 0 and len(pending) < _READ_BYTES:
                    continue  # wait for the line's end
                cut = cut or len(pending)
                self._emit(pending[:cut])
                pending = pending[cut:]
        except OSError:
            pass
        finally:
            if pending:
                self._emit(pending)
            self._pipe.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def text(self, lines: int = TAIL_LINES) -> str:
        """The child's last `lines` lines of output (progress-bar redraws count as lines)."""
        with self._lock:
            data = bytes(self._tail)
        text = data.decode("utf-8", errors="replace").replace("\r", "\n")
        return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])
