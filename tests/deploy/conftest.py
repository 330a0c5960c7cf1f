"""Fixtures for tests/deploy: the umbrella chart with its dependencies built (in a scratch copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .charts import build_umbrella


@pytest.fixture(scope="session")
def umbrella(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_umbrella(tmp_path_factory.mktemp("helm") / "helm")
