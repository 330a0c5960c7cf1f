"""Choosing a scheduler (data-parallel rank) for a request: SGLang's DataParallelController
policies `round_robin` and `shortest_queue`.

Candidates are the indices of the schedulers whose Connect stream is up; a load is the latest
SchedulerLoad that scheduler reported (None until it reports).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from meshlm.tokenizer.config import ROUTING_POLICIES
from meshlm.v1 import common_pb2


class Router:
    def __init__(self, policy: str) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._next = 0
        # Requests this replica sent since a scheduler's last load report: added to the reported
        # queue so a burst between reports does not all go to one scheduler.
        self._pending: dict[int, int] = {}

    def choose(
        self,
        candidates: Sequence[int],
        load_of: Callable[[int], common_pb2.SchedulerLoad | None],
    ) -> int:
        """One of `candidates` (non-empty, ascending indices)."""
        if not candidates:
            raise ValueError("no scheduler to choose from")
        if self.policy == "round_robin":
            # The first candidate at or after the cursor, so the order survives a gap.
            pick = next((c for c in candidates if c >= self._next), candidates[0])
            self._next = pick + 1
            return pick
        best, best_key = candidates[0], None
        for c in candidates:
            key = (self.queue_len(load_of(c)) + self._pending.get(c, 0), c)
            if best_key is None or key < best_key:
                best, best_key = c, key
        self._pending[best] = self._pending.get(best, 0) + 1
        return best

    @staticmethod
    def queue_len(load: common_pb2.SchedulerLoad | None) -> int:
        if load is None:
            return 0
        return load.num_queue_reqs + load.num_running_reqs

    def on_load(self, index: int) -> None:
        """A fresh load report from scheduler `index` includes what we sent it."""
        self._pending.pop(index, None)


def session_scheduler(session_id: str, num_schedulers: int) -> int | None:
    """The scheduler index a session id names: "s<j>-..." -> j; any other id -> a stable hash.
    None when the id names an index outside the current scheduler list."""
    if num_schedulers <= 0:
        return None
    if session_id.startswith("s"):
        head, sep, _ = session_id[1:].partition("-")
        if sep and head.isdigit():
            j = int(head)
            return j if j < num_schedulers else None
    return zlib.crc32(session_id.encode()) % num_schedulers
