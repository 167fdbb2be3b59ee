"""A killed worker on the Workers page: its cache leaves the capacity chart, its sessions' moves show.

liveness_cluster.py (w2 left the pool, w3 is down) plus two sessions whose next turns went from
w2 to w0 — records saying ``migrated_from: w2`` (hard: the cache stayed behind).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from exporter.web.api import ApiBuilders
from tests.console import liveness_cluster
from tests.console.conftest import _serve
from tests.console.test_pages import run, texts, worker_tables


@pytest.fixture
def moved_exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    state = liveness_cluster.build_state()
    state.ingest_records([{**liveness_cluster._record(980.0 + i, f"m{i}", "w0"), "session_key": f"s{i}",
                           "migrated_from": "w2", "migration_kind": "hard"} for i in range(2)], 985.0)
    assert ApiBuilders(state).routes()["workers"]({})["workers"][2]["migrated_away"] == {"hard": 2.0}
    for url in _serve(state):
        monkeypatch.setenv(EXPORTER_ENV, url)
        monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
        yield url


def test_a_gone_worker_is_no_capacity_and_its_sessions_moves_are_listed(moved_exporter: str) -> None:
    at = run("workers")
    assert "Not counted as capacity (down or left the pool): w2, w3." in texts(at)
    moved = worker_tables(at)["migrated_away"]
    assert moved.to_dict("records") == [{"Worker": "w2", "Liveness": "left the pool",
                                         "Sessions moved away (hard)": "2 sessions",
                                         "Sessions moved away (soft)": "—"}]
