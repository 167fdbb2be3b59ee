"""Culprits that explain the check: only entities whose own value departs from their peers', with why.

Hand-laid (the state's clock stands at 1000): eight workers stream KV events; w1 sent its last
batch at 914 (86 s ago), the others at 995–999 (≤ 5 s ago). Every worker holds the same
system prompt (a hot branch whose hits do not change between the windows); w2's own branch
lost its hits in the later window.
"""

from __future__ import annotations

from exporter.core.culprits import Culprits
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from prefixscope.catalog import CHECKS_BY_KEY
from prefixscope.thresholds import load_thresholds

NOW = 1_000.0
WORKERS = tuple(f"w{i}" for i in range(8))
SHARED = (0x5151_0000_0000_0001, 0x5151_0000_0000_0002)
OWN = {w: (0x1000 * (i + 1) + 1,) for i, w in enumerate(WORKERS)}


def _record(ts: float, rid: str, worker: str, chain: tuple[int, ...], cached: int) -> dict:
    return {"ts": ts, "request_id": rid, "worker": worker, "model": "m", "prompt_tokens": 16 * len(chain),
            "block_hashes": list(chain), "cached_tokens": cached}


def build() -> ClusterState:
    now = [NOW]
    state = ClusterState.build(Health(), load_thresholds(), clock=lambda: now[0])
    for i, w in enumerate(WORKERS):
        at = 914.0 if w == "w1" else 995.0 + i % 5
        state.apply_kv_batch(KvBatch(w, 0, at, (BlockStored((*SHARED, *OWN[w]), None, 16),)), at)
    records = []
    for window, base in (("a", 450.0), ("b", 750.0)):  # the previous window, then the current one
        for i, w in enumerate(WORKERS):
            records.append(_record(base + i, f"{window}s{i}", w, SHARED, 32))  # the shared prompt: steady
            if w == "w2" and window == "a":
                records += [_record(base + 10 + k, f"own{k}", w, (*SHARED, *OWN[w]), 48) for k in range(4)]
    state.ingest_records(records, 960.0)
    state.refresh_tree_stats()
    return state


def test_only_the_stale_worker_is_named_for_kv_staleness_with_why() -> None:
    state = build()
    got = state.snapshot_for(lambda st: Culprits(st).of(CHECKS_BY_KEY["kv_event_staleness"]))
    assert [w["worker"] for w in got["workers"]] == ["w1"]
    assert got["workers"][0]["why"] == "w1: 1 m 26 s since its last KV event; the others ≤ 5 s"
    # Staleness has no prefix or session series: none are named.
    assert got["prefixes"] == [] and got["sessions"] == []


def test_a_check_without_a_per_worker_series_names_no_worker() -> None:
    state = build()
    got = state.snapshot_for(lambda st: Culprits(st).of(CHECKS_BY_KEY["sticky_session_collision_rate"]))
    assert got["workers"] == [] and got["nodes"] == []


def test_a_prefix_held_by_every_worker_is_no_culprit_unless_its_hits_changed() -> None:
    state = build()
    got = state.snapshot_for(lambda st: Culprits(st).of(CHECKS_BY_KEY["prefix_hit_rate_total"]))
    named = [p["branch"] for p in got["prefixes"]]
    assert named and all(not b.startswith("5151") for b in named)  # the steady shared prompt is not listed
    assert all("fell from" in p["why"] for p in got["prefixes"])
