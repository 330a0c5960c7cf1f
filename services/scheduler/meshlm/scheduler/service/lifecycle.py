"""The service's state beyond its requests (draining, crashed) and the graceful drain.

Drain (SIGTERM): new requests are refused with 503, running ones get until shortly before the
grace period ends to finish, the rest fail with 503 on their Connect streams (the tokenizer may
retry elsewhere), outputs are flushed to the detokenizer, then every Connect stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from meshlm.scheduler.service.connections import ConnectionRegistry
from meshlm.scheduler.service.detok_client import DetokenizerPushClient
from meshlm.scheduler.service.endings import RequestEnds
from meshlm.scheduler.service.tracker import RequestTracker

logger = logging.getLogger(__name__)


@dataclass
class ServiceState:
    """draining: refusing new requests. crashed: the loop died (the message every request gets)."""

    draining: bool = False
    crashed: str | None = None


async def drain(
    grace_s: float,
    *,
    scheduler_id: str,
    state: ServiceState,
    tracker: RequestTracker,
    ends: RequestEnds,
    detok: DetokenizerPushClient,
    connections: ConnectionRegistry,
) -> None:
    """Stop accepting requests, let running ones finish within grace_s, fail the rest, flush
    their outputs to the detokenizer, then end every Connect stream."""
    state.draining = True
    deadline = time.monotonic() + grace_s
    finish_by = deadline - min(1.5, grace_s / 2)
    while tracker.num_live() and time.monotonic() < finish_by and not state.crashed:
        await asyncio.sleep(0.05)
    left = tracker.live()
    if left:
        logger.warning("grace period over: aborting %d requests", len(left))
        ends.fail_live(f"scheduler {scheduler_id} shut down before the request finished", 503)
    await detok.flush(max(deadline - time.monotonic() - 0.2, 0.1))
    connections.close_all()
