"""A shared engine and the pools-are-whole check every engine test ends with (the golden
prompts and HF reference live in tests/golden.py and tests/conftest.py)."""

from __future__ import annotations

import pytest

from meshlm.scheduler.engine import Engine
from tests.golden import (  # noqa: F401 (re-exported for the engine tests)
    CHAT_PROMPTS,
    GOLDEN_NEW_TOKENS,
    RAW_PROMPTS,
    TEST_DEVICE,
    Golden,
    chat_ids,
)


def assert_pools_whole(engine: Engine) -> None:
    """free + evictable == capacity, nothing locked, no request row held."""
    load = engine.get_load()  # also waits until the loop has processed everything before it
    mem = engine.scheduler.memory
    assert load.num_running_reqs == 0 and load.num_queue_reqs == 0
    assert mem.allocator.available_size() + mem.tree_cache.evictable_size() == mem.max_total_num_tokens
    assert mem.tree_cache.protected_size() == 0
    assert mem.req_to_token_pool.available_size() == mem.req_to_token_pool.size


@pytest.fixture(scope="session")
def smollm_engine(smollm_path: str):
    """One float32 SmolLM2 engine with the default scheduling flags, shared by feature tests."""
    eng = Engine(dtype="float32", model_path=smollm_path, max_total_tokens=16384, load_progress=False)
    yield eng
    eng.shutdown()
