"""SchedulerPort: the scheduler loop's only door to the outside (queue in, callbacks out).

The in-process Engine and the gRPC servicer both drive the loop through a port: they put
request messages in from any thread; the loop thread drains them and calls the output
callbacks (which must be cheap and thread-safe, e.g. loop.call_soon_threadsafe).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from meshlm.scheduler.managers.io_struct import ControlOutput, InputMessage, OutputMessage

OutputCallback = Callable[[Any], None]


class _Wake:
    """What wake() puts in the inbox; recv_requests never returns it."""


class SchedulerPort:
    def __init__(self, on_output: OutputCallback, on_control: OutputCallback) -> None:
        self._inbox: queue.Queue[InputMessage] = queue.Queue()
        self._on_output = on_output
        self._on_control = on_control

    # called by producers (any thread)
    def put(self, msg: InputMessage) -> None:
        self._inbox.put(msg)

    def wake(self) -> None:
        """End a blocking recv_requests early (e.g. a grammar compile finished); any thread."""
        self._inbox.put(_Wake())  # type: ignore[arg-type]

    # called by the loop thread
    def recv_requests(self, block: bool, timeout: float = 0.05) -> list[InputMessage]:
        """Everything queued now; when `block`, wait up to `timeout` for the first message."""
        msgs: list[InputMessage] = []
        if block:
            try:
                msgs.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return msgs
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return [m for m in msgs if not isinstance(m, _Wake)]

    def send_output(self, msg: OutputMessage) -> None:
        self._on_output(msg)

    def send_control(self, msg: ControlOutput) -> None:
        self._on_control(msg)
