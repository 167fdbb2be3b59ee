"""Alert grouping and tree shaping (pure helpers behind the Alerts and Prefix tree pages)."""

from __future__ import annotations

from console.alert_groups import group_alerts
from console.tree_view import bucket_rows, icicle_columns, removal_ranking
from tests.console import topology_cluster


def alert(name: str, state: str = "firing", active: str = "2026-11-29T10:00:00Z", **labels: str) -> dict:
    return {"labels": {"alertname": name, "severity": labels.pop("severity", "warning"), **labels},
            "state": state, "activeAt": active, "value": "1e+00", "annotations": {"summary": f"{name}."}}


def test_alerts_grouped_by_name_deduplicated_with_shared_labels_once() -> None:
    alerts = [
        alert("PrefixCacheNearCapacity", worker="w0"),
        alert("PrefixCacheNearCapacity", worker="w1"),
        alert("PrefixCacheNearCapacity", worker="w0", active="2026-11-29T09:00:00Z"),  # same alert, 2nd replica
        alert("PrefixTelemetryKvEventGaps", worker="w2"),
        alert("PrefixTreeTooDeep", severity="info"),
        alert("PrefixHitRateLow", state="pending"),
    ]
    groups = group_alerts(alerts)
    assert [g.alertname for g in groups] == ["PrefixTelemetryKvEventGaps", "PrefixCacheNearCapacity", "PrefixTreeTooDeep"]
    cap = groups[1]
    assert cap.common_labels == {"alertname": "PrefixCacheNearCapacity", "severity": "warning"}
    assert [r.labels for r in cap.rows] == [{"worker": "w0"}, {"worker": "w1"}]
    assert cap.rows[0].active_at == "2026-11-29T09:00:00Z"  # the earliest of the duplicates
    assert cap.step == 1 and cap.known


def test_unknown_alerts_are_kept_but_not_linked() -> None:
    (g,) = group_alerts([alert("SomethingElse")])
    assert not g.known and g.step is None


def test_icicle_columns_use_unique_paths_subtree_totals_and_readable_hovers() -> None:
    api = topology_cluster.routes(1_800_000_000.0)
    root = api["tree"]({})["root"]
    s, a, b, c = "root/5151000000000001", "root/5151000000000001/1a1a000000000001", \
        "root/5151000000000001/1b1b000000000001", "root/1c1c000000000001"
    cols = icicle_columns(root, "hits")
    assert sorted(zip(cols["ids"], cols["parents"], strict=True)) == sorted(
        [("root", ""), (s, "root"), (a, s), (b, s), (c, "root")])
    # Hit tokens per node = 16 per hit per block (topology_cluster.py): S 7 hits × 2 blocks,
    # A 4 × 3, B 2 × 2, C 3 × 2; each node carries its subtree's total.
    values = dict(zip(cols["ids"], cols["values"], strict=True))
    assert values == {"root": 576.0, s: 480.0, a: 192.0, b: 64.0, c: 96.0}
    assert cols["labels"][cols["ids"].index(a)] == "1a1a0000 (3 blocks)"  # no text served: hash and length
    assert "held by w0, w1" in cols["hover"][cols["ids"].index(a)]
    assert "192 tokens cached in the window" in cols["hover"][cols["ids"].index(a)]


def test_icicle_slivers_collapse_into_n_more_and_text_names_nodes() -> None:
    big = {"id": "aa", "hit_tokens": 1000, "text": "You are a support agent for ACME billing. Answer briefly."}
    tiny = [{"id": f"t{i}", "hit_tokens": 1} for i in range(5)]
    cols = icicle_columns({"id": "root", "children": [big, *tiny]}, "hits", min_share=0.02)
    assert cols["labels"] == ["all prefixes", "You are a support agent for…", "5 more"]
    assert cols["values"] == [1005.0, 1000.0, 5.0]


def test_bucket_rows_skip_malformed_pairs() -> None:
    assert bucket_rows([[1, 10], [2], "x", [4, 1]], "children", "nodes") == \
        [{"children": 1, "nodes": 10}, {"children": 4, "nodes": 1}]


def test_removal_ranking_puts_unranked_workers_last() -> None:
    workers = topology_cluster.routes(1_800_000_000.0)["hotspots"]({})["workers"]
    workers = [*workers, {"worker": "w9", "resident_blocks": None, "capacity_blocks": None}]
    # Ranked by effective cache value (w3 < w0 < w1); w2 has none in the window, w9 no data at all.
    assert [r["worker"] for r in removal_ranking(workers)] == ["w3", "w0", "w1", "w2", "w9"]
    assert removal_ranking(workers)[-1]["used"] is None
