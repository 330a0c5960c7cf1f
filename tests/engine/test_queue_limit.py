"""--max-queued-requests counts only the requests that must wait: those the free running slots
will take at the next step are about to run (a burst at a server with room is not refused)."""

from __future__ import annotations

import asyncio

import pytest

from meshlm.scheduler.engine import Engine, RequestError
from tests.engine.conftest import assert_pools_whole


def burst(n: int) -> list[dict]:
    return [{"input_ids": [100 + i] * 8, "sampling_params": {"max_new_tokens": 3}} for i in range(n)]


def outcomes(eng: Engine, n: int) -> list[str]:
    """'ok' or the refusal message of each of n requests submitted together."""

    async def one(r: dict) -> str:
        try:
            out = await eng.generate(**r)
            assert len(out["output_ids"]) == 3
            return "ok"
        except RequestError as e:
            return str(e)

    async def run() -> list[str]:
        return list(await asyncio.gather(*(one(r) for r in burst(n))))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine(smollm_path: str):
    eng = Engine(
        dtype="float32",
        model_path=smollm_path,
        max_total_tokens=4096,
        max_running_requests=2,
        max_queued_requests=1,
        load_progress=False,
    )
    yield eng
    eng.shutdown()


def test_a_burst_fills_the_free_running_slots_and_one_waits(engine: Engine) -> None:
    assert outcomes(engine, 3) == ["ok"] * 3  # two run at once, one waits: within the cap
    assert_pools_whole(engine)


def test_beyond_slots_and_queue_the_rest_are_refused_naming_the_limit(engine: Engine) -> None:
    results = outcomes(engine, 5)
    refused = [r for r in results if r != "ok"]
    assert results.count("ok") >= 3 and refused, results
    assert all("max_queued_requests=1" in r for r in refused), refused
    assert_pools_whole(engine)
