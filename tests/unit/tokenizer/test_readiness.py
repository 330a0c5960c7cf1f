"""The tokenizer's health follows its peers even when they come up between the first status and
the start of the tracking task (a race that once left a ready tokenizer NOT_SERVING for good)."""

from __future__ import annotations

import asyncio

from meshlm.tokenizer.service import _track_readiness


class FakeServer:
    def __init__(self) -> None:
        self.statuses: list[bool] = []

    async def set_serving(self, serving: bool) -> None:
        self.statuses.append(serving)


class FakeManager:
    def __init__(self, ready: bool) -> None:
        self.ready = ready

    def peers_ready(self) -> bool:
        return self.ready


def test_peers_that_came_up_before_tracking_started_flip_health_to_serving() -> None:
    async def run() -> list[bool]:
        server, manager = FakeServer(), FakeManager(ready=True)  # up since NOT_SERVING was set
        task = asyncio.create_task(_track_readiness(server, manager, False, period_s=0.01))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        manager.ready = False
        await asyncio.sleep(0.05)
        task.cancel()
        return server.statuses

    assert asyncio.run(run()) == [True, False]
