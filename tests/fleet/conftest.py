"""Shared helpers for the fleet tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO / ".." / "shared" / "data"
ROUTERS_BIN = REPO / ".routers" / "bin"


@pytest.fixture
def mooncake_trace() -> Path:
    path = SHARED_DATA / "mooncake_synthetic_trace.jsonl"
    if not path.exists():
        pytest.skip(f"the shared data folder is absent ({path.name} not found beside the repository)")
    return path


@pytest.fixture
def routers_bin() -> Path:
    if not (ROUTERS_BIN / "python").exists():
        msg = "the router venv .routers is missing (run `make routers`)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return ROUTERS_BIN
