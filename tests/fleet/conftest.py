"""Shared helpers for the fleet tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.routers import require_routers_bin

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO / ".." / "shared" / "data"


@pytest.fixture
def mooncake_trace() -> Path:
    path = SHARED_DATA / "mooncake_synthetic_trace.jsonl"
    if not path.exists():
        pytest.skip(f"the shared data folder is absent ({path.name} not found beside the repository)")
    return path


@pytest.fixture
def routers_bin() -> Path:
    return require_routers_bin()
