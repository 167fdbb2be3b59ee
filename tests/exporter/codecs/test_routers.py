"""Router adapters: kind detection and each router's own series mapped onto the snapshot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from exporter.codecs import normalize, routers
from exporter.codecs.routers.common import histogram
from exporter.core.health import Health
from exporter.core.state import ClusterState
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PAGES = {
    "sglang-router": FIXTURES / "sglang_router_metrics.txt",  # the 0.3.2 wheel's own output
    "vllm-router": FIXTURES / "vllm_router_metrics.txt",  # the 0.1.17 wheel's own output
    "dynamo": FIXTURES / "routers" / "dynamo_kv_router.txt",
    "llm-d": FIXTURES / "routers" / "llmd_epp.txt",
}


@pytest.mark.parametrize("kind", sorted(PAGES))
def test_auto_detects_each_router(kind: str) -> None:
    snap, errors = normalize.parse_router("r", PAGES[kind].read_text())
    assert errors == [] and snap.kind == kind


def test_kinds_are_the_config_kinds() -> None:
    assert routers.KINDS == ("auto", "sglang-router", "vllm-router", "dynamo", "llm-d")


def test_dynamo_predicted_reuse_and_lookup_latency_in_seconds() -> None:
    snap, _ = normalize.parse_router("d", PAGES["dynamo"].read_text())
    assert snap.decisions == {} and snap.prefix_outcomes == {}  # Dynamo exports neither: missing
    assert snap.lookup_seconds is not None and snap.lookup_seconds.bounds == (0.001, 0.005, 0.01, math.inf)
    assert snap.lookup_seconds.counts == (4, 9, 10, 10) and snap.lookup_seconds.sum == pytest.approx(0.021)
    assert snap.predicted_hit_ratio is not None and snap.predicted_hit_ratio.count == 10


def test_llmd_hits_and_misses_from_lookups() -> None:
    snap, _ = normalize.parse_router("l", PAGES["llm-d"].read_text())
    assert snap.prefix_outcomes == {"hit": 30.0, "miss": 10.0}
    assert snap.lookup_seconds is not None and snap.lookup_seconds.count == 40


def test_smg_1_11_branches_and_match_ratio() -> None:
    names = normalize.worker_names_by_url([("w0", "http://10.0.0.5:8000/metrics")])
    snap, _ = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_11.txt").read_text(), "auto", names)
    assert snap.kind == "sglang-router"
    assert snap.decisions == {"w0": 7.0, "http://10.0.0.6:8000": 3.0}
    assert snap.healthy == {"w0": 1.0, "http://10.0.0.6:8000": 0.0}
    assert snap.prefix_outcomes == {"hit": 8.0, "miss": 2.0}
    assert snap.predicted_hit_ratio is not None and snap.predicted_hit_ratio.counts[-1] == 10


def test_the_real_smg_1_13_in_front_of_http_workers() -> None:
    """The real gateway's page: every send per worker (one that got none at 0), its tree branches
    and match ratio; the KV-index lookup is not timed in HTTP tree mode, so it stays absent."""
    names = normalize.worker_names_by_url([(f"w{i}", f"http://10.0.0.{5 + i}:8000/metrics") for i in range(3)])
    snap, errors = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_http.txt").read_text(), "auto", names)
    assert errors == [] and snap.kind == "sglang-router"
    assert snap.decisions == {"w0": 0.0, "w1": 3.0, "w2": 6.0}
    assert snap.healthy == {"w0": 1.0, "w1": 1.0, "w2": 1.0}
    assert snap.prefix_outcomes == {"hit": 6.0, "miss": 3.0}  # expected_wait_fallback: not routed by a match
    assert snap.predicted_hit_ratio is not None and snap.predicted_hit_ratio.count == 9
    assert snap.lookup_seconds is None


def test_the_router_tree_is_read_against_its_bound() -> None:
    """smg sets its tree gauges at each eviction pass: the largest model tree (characters of its HTTP
    string tree here, its token tree empty) against --max-tree-size, the default or the configured one."""
    page = (FIXTURES / "routers" / "smg_1_13_tree.txt").read_text()
    snap, errors = normalize.parse_router("s", page)
    assert errors == [] and (snap.largest_tree, snap.tree_bound) == (2088.0, 67_108_864)
    snap, _ = normalize.parse_router("s", page, max_tree_size=4096)
    assert snap.tree_bound == 4096
    # before the first eviction pass (and in sglang-router 0.3.x) there is no tree gauge: missing, not 0
    snap, _ = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_http.txt").read_text(), max_tree_size=4096)
    assert (snap.largest_tree, snap.tree_bound) == (None, None)
    text = ('vllm_router_tree_size{worker="http://a"} 700\nvllm_router_tree_size{worker="http://b"} 1500\n'
            'vllm_router_worker_health{worker="http://a"} 1\n')
    snap, _ = normalize.parse_router("v", text)
    assert snap.kind == "vllm-router" and (snap.largest_tree, snap.tree_bound) == (1500.0, 33_554_432)


def test_the_gateways_engine_hit_ratio_per_worker() -> None:
    """The mean over a worker's DP ranks; a removed worker's -1 is no reading, not a zero."""
    names = {"grpc://10.0.0.5:30000": "w0"}
    snap, errors = normalize.parse_router("s", (FIXTURES / "routers" / "smg_engine_load.txt").read_text(), "auto", names)
    assert errors == [] and snap.kind == "sglang-router"
    assert snap.engine_hit_ratio == {"w0": pytest.approx(0.7), "grpc://10.0.0.7:30000": 0.25}
    st = ClusterState.build(Health(), load_thresholds(), window_s=300.0, clock=lambda: 1000.0)
    st.observe_router(snap, 1000.0)
    got = st.series().gauges[f"{catalog.NAMESPACE}_router_engine_hit_ratio"]
    assert got == {("s", "w0"): pytest.approx(0.7), ("s", "grpc://10.0.0.7:30000"): 0.25}


def test_the_tree_fill_is_exported_per_router() -> None:
    st = ClusterState.build(Health(), load_thresholds(), window_s=300.0, clock=lambda: 1000.0)
    snap, _ = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_tree.txt").read_text(), max_tree_size=4176)
    st.observe_router(snap, 1000.0)
    got = st.series().gauges[f"{catalog.NAMESPACE}_router_tree_fill_ratio"]
    assert got == {("s",): pytest.approx(0.5)}


def test_smg_1_13_kv_index_lookup_feeds_the_walk_latency() -> None:
    snap, _ = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_kv_index.txt").read_text())
    assert snap.kind == "sglang-router" and snap.decisions == {"http://10.0.0.5:8000": 4.0, "http://10.0.0.6:8000": 0.0}
    assert snap.lookup_seconds is not None
    assert snap.lookup_seconds.counts == (1, 3, 4, 4) and snap.lookup_seconds.sum == pytest.approx(0.0000925)


def test_sglang_0_3_2_has_no_outcome_and_no_ratio() -> None:
    snap, _ = normalize.parse_router("s", PAGES["sglang-router"].read_text())
    assert snap.prefix_outcomes == {} and snap.predicted_hit_ratio is None and snap.lookup_seconds is None


def test_legacy_sgl_router_names() -> None:
    text = ('sgl_router_policy_decisions_total{policy="cache_aware",worker="http://a"} 5\n'
            "sgl_router_cache_hits_total 4\nsgl_router_cache_misses_total 1\n")
    snap, _ = normalize.parse_router("s", text)
    assert snap.kind == "sglang-router" and snap.decisions == {"http://a": 5.0}
    assert snap.prefix_outcomes == {"hit": 4.0, "miss": 1.0}


def test_a_configured_kind_wins_and_an_unknown_page_is_refused() -> None:
    snap, _ = normalize.parse_router("r", PAGES["llm-d"].read_text(), "dynamo")
    assert snap.kind == "dynamo" and snap.lookup_seconds is None
    with pytest.raises(normalize.UnrecognisedMetrics):
        normalize.parse_router("r", "node_cpu_seconds_total 1\n")


def test_histogram_rejects_non_cumulative_buckets() -> None:
    from exporter.codecs import promtext
    p = promtext.parse('h_bucket{le="1"} 5\nh_bucket{le="+Inf"} 3\n')
    assert histogram(p, "h") is None


def test_router_lookup_latency_feeds_the_walk_check() -> None:
    th = load_thresholds()
    st = ClusterState.build(Health(), th, window_s=300.0, clock=lambda: 1000.0)
    text = PAGES["llm-d"].read_text()
    first, _ = normalize.parse_router("l", text)
    st.observe_router(first, 1000.0)  # the baseline
    more = text.replace("le=\"0.005\"} 38", "le=\"0.005\"} 58").replace("le=\"0.01\"} 40", "le=\"0.01\"} 80") \
        .replace("le=\"+Inf\"} 40", "le=\"+Inf\"} 80")
    second, _ = normalize.parse_router("l", more)
    st.observe_router(second, 1005.0)
    assert st.signals()["walk_latency"]
    got = st.store.window_buckets(f"{catalog.NAMESPACE}_router_tree_walk_seconds")
    assert got is not None
    bounds, counts = got
    cumulative = [sum(counts[: i + 1]) for i in range(len(bounds))]
    assert cumulative[bounds.index(0.005)] == 20 and cumulative[bounds.index(0.01)] == 40  # each in its router bucket


def test_the_catalogue_matrix_says_what_the_adapters_feed() -> None:
    """ROUTER_FEEDS (docs/routers.md) against what each adapter fills in from a page it reads."""
    pages = {kind: [page] for kind, page in PAGES.items()}
    pages["sglang-router"] = [FIXTURES / "routers" / n for n in ("smg_1_11.txt", "smg_1_13_kv_index.txt",
                                                                  "smg_1_13_manual.txt", "smg_1_13_kv_events.txt",
                                                                  "smg_1_13_tree.txt", "smg_engine_load.txt")]
    pages["dynamo"] += [FIXTURES / "routers" / "dynamo_router_regret.txt", FIXTURES / "routers" / "dynamo_router_overhead.txt"]
    field_of = {"router_decisions": "decisions", "router_prefix_outcomes": "prefix_outcomes",
                "router_worker_healthy": "healthy", "router_predicted_hit_ratio": "predicted_hit_ratio",
                "router_tree_walk_seconds": "lookup_seconds", "router_sticky_followups": "sticky_followups",
                "router_regret_selections": "regret_selections", "router_regret_blocks": "regret_blocks",
                "router_routed_requests": "routed_requests", "router_kv_index_faults": "index_faults",
                "router_kv_event_lag_seconds": "kv_event_lag_seconds", "router_tree_fill_ratio": "largest_tree",
                "router_overhead_seconds": "overhead_seconds", "router_engine_hit_ratio": "engine_hit_ratio"}
    assert routers.KINDS[1:] == catalog.ROUTER_KINDS
    for series, feeds in catalog.ROUTER_FEEDS.items():
        fld = field_of[series.removeprefix(f"{catalog.NAMESPACE}_")]
        for kind, source in feeds.items():
            fed = [bool(getattr(normalize.parse_router("r", page.read_text(), kind)[0], fld)) for page in pages[kind]]
            assert any(fed) == (source is not None), (series, kind)


# ---- the routers' own signals: affinity branches, regret, index health ---------------------------
def test_the_real_smg_1_13_manual_policy_sessions_kept_and_migrated() -> None:
    """occupied_hit kept its worker; occupied_miss found none of its key's workers healthy (a
    migration); vacant is a session's first request, not a follow-up."""
    snap, errors = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_manual.txt").read_text())
    assert errors == [] and snap.kind == "sglang-router"
    assert snap.sticky_followups == {("manual", "kept"): 10.0, ("manual", "collision"): 0.0,
                                     ("manual", "migration"): 2.0}
    assert snap.healthy["http://10.0.0.6:8000"] == 0.0
    assert snap.index_faults == {} and snap.kv_event_lag_seconds is None  # HTTP workers: no KV events


def test_the_real_smg_1_13_prefix_hash_ring_hits_are_kept() -> None:
    snap, _ = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_prefix_hash.txt").read_text())
    assert snap.sticky_followups == {("prefix_hash", "kept"): 18.0, ("prefix_hash", "collision"): 0.0,
                                     ("prefix_hash", "migration"): 0.0}


def test_smg_kv_event_health_faults_and_lag() -> None:
    """Unrecovered gaps and stream resets are faults; a replayed gap, a publisher restart, a snapshot
    and gap_cleared (the unrecovered gap again) are not counted."""
    snap, errors = normalize.parse_router("s", (FIXTURES / "routers" / "smg_1_13_kv_events.txt").read_text())
    assert errors == [] and snap.kind == "sglang-router"
    assert snap.index_faults == {"gap_unrecovered": 3.0, "stream_resync": 1.0}
    lag = snap.kv_event_lag_seconds
    assert lag is not None and lag.count == 15 and lag.sum == pytest.approx(10.061)
    assert lag.counts[lag.bounds.index(0.0025)] == 2 and lag.counts[lag.bounds.index(1.0)] == 10  # summed over workers
    # walks off the hash ring are collisions; fallback_least_load is no follow-up of a ring worker
    assert snap.sticky_followups[("prefix_hash", "collision")] == 10.0
    assert snap.sticky_followups[("prefix_hash", "kept")] == 30.0


def test_dynamo_regret_and_apply_failures() -> None:
    snap, errors = normalize.parse_router("d", (FIXTURES / "routers" / "dynamo_router_regret.txt").read_text())
    assert errors == [] and snap.kind == "dynamo"
    assert (snap.regret_selections, snap.regret_blocks, snap.routed_requests) == (12.0, 96.0, 200.0)
    assert snap.index_faults == {"apply_failed": 9.0}  # every status but ok, over every event type
    # the older page has none of them: missing, never 0
    old, _ = normalize.parse_router("d", PAGES["dynamo"].read_text())
    assert old.regret_selections is None and old.index_faults == {} and old.routed_requests == 10.0


def _scrape_twice(st: ClusterState, first: str, second: str) -> None:
    snap, _ = normalize.parse_router("r", first)
    st.observe_router(snap, 1000.0)  # the baseline
    snap, _ = normalize.parse_router("r", second)
    st.observe_router(snap, 1005.0)


def test_router_signals_enter_the_windows_and_light_their_checks() -> None:
    """Scrape over scrape: the router's totals are exported as they are and their increases enter
    the windows; the step-0 fault check and the step-2 collision check read them without records."""
    from exporter.core.checks import evaluate
    th = load_thresholds()
    st = ClusterState.build(Health(), th, window_s=300.0, clock=lambda: 1000.0)
    text = (FIXTURES / "routers" / "smg_1_13_kv_events.txt").read_text()
    more = (text.replace('outcome="unrecovered_kept"} 1', 'outcome="unrecovered_kept"} 3')
            .replace('branch="ring_hit"} 30', 'branch="ring_hit"} 45')
            .replace('branch="load_balance_walk"} 10', 'branch="load_balance_walk"} 15'))
    _scrape_twice(st, text, more)
    P = catalog.NAMESPACE
    assert st.store.window_counter(f"{P}_router_kv_index_faults") == 2.0
    assert st.store.window_counter(f"{P}_router_sticky_followups") == 20.0
    assert st.store.cum.counters[f"{P}_router_sticky_followups"][("r", "prefix_hash", "collision")] == 15.0
    ev = evaluate(st, 1005.0)
    faults = ev.results["router_kv_index_faults"]
    assert faults.value == 2.0 and faults.status == "firing"
    sticky = ev.results["sticky_session_collision_rate"]
    assert sticky.value == pytest.approx(5 / 20) and sticky.missing_signals == []
    assert ev.signals["affinity_outcomes"] and ev.signals["router_index_health"] and not ev.signals["session_key"]


def test_a_router_restart_counts_its_new_totals() -> None:
    th = load_thresholds()
    st = ClusterState.build(Health(), th, window_s=300.0, clock=lambda: 1000.0)
    text = (FIXTURES / "routers" / "dynamo_router_regret.txt").read_text()
    restarted = (text.replace('worker_type="prefill"} 12', 'worker_type="prefill"} 3')
                 .replace("router_requests_total{dynamo_namespace=\"ns\",dynamo_component=\"router\",router_id=\"7587889431\"} 200",
                          "router_requests_total{dynamo_namespace=\"ns\",dynamo_component=\"router\",router_id=\"7587889431\"} 30"))
    _scrape_twice(st, text, restarted)
    P = catalog.NAMESPACE
    assert st.store.window_counter(f"{P}_router_regret_selections") == 3.0
    assert st.store.window_counter(f"{P}_router_routed_requests") == 30.0


def test_the_routers_belief_and_regret_reach_the_reuse_decomposition() -> None:
    """/api/v1/groups' reuse carries what the router says of itself: its predicted share (median of
    its picks in the window) and its regret picks against the requests it routed."""
    from exporter.core.checks import evaluate
    st = ClusterState.build(Health(), load_thresholds(), window_s=300.0, clock=lambda: 1000.0)
    text = (FIXTURES / "routers" / "dynamo_router_regret.txt").read_text()
    rid = 'router_id="7587889431"'
    more = (text.replace('worker_type="prefill"} 12', 'worker_type="prefill"} 18')
            .replace(f'requests_total{{dynamo_namespace="ns",dynamo_component="router",{rid}}} 200',
                     f'requests_total{{dynamo_namespace="ns",dynamo_component="router",{rid}}} 300')
            .replace(f'kv_hit_rate_bucket{{dynamo_namespace="ns",dynamo_component="router",{rid},le="1"}} 200',
                     f'kv_hit_rate_bucket{{dynamo_namespace="ns",dynamo_component="router",{rid},le="1"}} 300')
            .replace(f'kv_hit_rate_bucket{{dynamo_namespace="ns",dynamo_component="router",{rid},le="+Inf"}} 200',
                     f'kv_hit_rate_bucket{{dynamo_namespace="ns",dynamo_component="router",{rid},le="+Inf"}} 300')
            .replace(f'kv_hit_rate_sum{{dynamo_namespace="ns",dynamo_component="router",{rid}}} 142',
                     f'kv_hit_rate_sum{{dynamo_namespace="ns",dynamo_component="router",{rid}}} 222')
            .replace(f'kv_hit_rate_count{{dynamo_namespace="ns",dynamo_component="router",{rid}}} 200',
                     f'kv_hit_rate_count{{dynamo_namespace="ns",dynamo_component="router",{rid}}} 300'))
    _scrape_twice(st, text, more)
    reuse = evaluate(st, 1005.0).reuse
    assert (reuse["router_regret_selections"], reuse["router_routed_requests"]) == (6.0, 100.0)
    # 100 new picks in Dynamo's (0.5, 1], their sum 80: each placed at 0.8 inside that bucket, so they
    # fall in the catalogue's (0.7, 0.8] and the median reads inside it (as histogram_quantile would)
    assert 0.7 < reuse["router_predicted_hit_ratio_p50"] <= 0.8
