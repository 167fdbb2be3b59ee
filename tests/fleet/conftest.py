"""Shared helpers for the fleet tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.routers import require_routers_bin
from tests.shared_data import MOONCAKE, require


@pytest.fixture
def mooncake_trace() -> Path:
    return require(MOONCAKE)


@pytest.fixture
def routers_bin() -> Path:
    return require_routers_bin()
