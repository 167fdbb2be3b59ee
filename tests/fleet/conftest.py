"""Shared helpers for the fleet tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_data import MOONCAKE, require
from tests.support import require_routers_bin


@pytest.fixture
def mooncake_trace() -> Path:
    return require(MOONCAKE)


@pytest.fixture
def routers_bin() -> Path:
    return require_routers_bin()
