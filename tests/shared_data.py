"""The public data set that sits beside the repository (``../shared/data``).

Locally a missing data folder skips the tests that need it; in CI (``CI`` set) it fails them,
because CI always has the folder and a skip there would hide a broken path.
"""

from __future__ import annotations

from pathlib import Path

from tests.support import unavailable

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MOONCAKE = SHARED_DATA / "mooncake_synthetic_trace.jsonl"


def require(path: Path) -> Path:
    if path.is_file():
        return path
    unavailable(f"the shared data folder is absent ({path.name} not found beside the repository)")
