"""SchedulerState: where every live request of one scheduler is, between two loop steps.

A live (unfinished) request is in exactly one place:

    waiting_queue     admitted, holds no KV and no row (new, or retracted: prefilled again)
    transfer_queue    decode role: prefilled elsewhere, its KV received, no row here yet
    chunked_req       its prompt is being prefilled chunk by chunk (holds a row and KV)
    last_batch        the EXTEND batch just run, when the request sampled there (holds KV);
                      get_next_batch_to_run merges it into running_batch first thing
    running_batch     decoding (holds a row and KV)

A finished request may still sit in running_batch or last_batch until the next
get_next_batch_to_run filters it out. Owned by the loop thread; every part of the scheduler
that moves requests is given this object.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from meshlm.scheduler.managers.req import Req
from meshlm.scheduler.managers.schedule_batch import ScheduleBatch
from meshlm.scheduler.model_executor.forward_batch_info import ForwardMode


class PendingTransfer(NamedTuple):
    """A request handed over by a prefill scheduler and its prompt's KV (a CPU tensor
    [layers, 2, len(prompt), kv_heads, head_dim]), waiting for a row and slots here."""

    req: Req
    kv: torch.Tensor


@dataclass
class SchedulerState:
    running_batch: ScheduleBatch
    new_token_ratio: float  # share of running requests' remaining tokens a prefill reserves
    waiting_queue: list[Req] = field(default_factory=list)
    transfer_queue: deque[PendingTransfer] = field(default_factory=deque)
    chunked_req: Req | None = None
    last_batch: ScheduleBatch | None = None

    def last_prefilled(self) -> list[Req]:
        """Requests that sampled in the EXTEND batch just run and are not merged yet."""
        last = self.last_batch
        if last is None or last.forward_mode is not ForwardMode.EXTEND:
            return []
        return last.sampling_reqs

    def running_reqs(self) -> list[Req]:
        """Unfinished requests holding KV: decoding, or prefilled and not merged yet."""
        live = list(self.running_batch.reqs)
        live += [r for r in self.last_prefilled() if r not in self.running_batch.reqs]
        return [r for r in live if not r.finished()]

    def has_live_requests(self) -> bool:
        """Whether any unfinished request is waiting, transferring, chunked, decoding or just
        prefilled."""
        return bool(self.waiting_queue or self.transfer_queue or self.chunked_req is not None or self.running_reqs())

    def nothing_queued(self) -> bool:
        """No request waits to be scheduled and none decodes (a last batch may still be due)."""
        return (
            self.chunked_req is None
            and not self.waiting_queue
            and not self.transfer_queue
            and self.running_batch.is_empty()
        )
