"""The reference router's own /metrics: what each flavour's page says about the router's decisions."""

from __future__ import annotations

from collections import Counter

from exporter.codecs.normalize import parse_router
from fleet import router_metrics as rm
from fleet.scenarios import load_preset
from fleet.simulation import Simulation
from fleet.topology import load_topology


def samples(page: str) -> dict[str, float]:
    """Sample line (name and labels as written) -> value."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def lookup(matched: bool, any_matched: bool | None = None, walk_s: float = 1e-4, ratio: float = 0.0) -> rm.Lookup:
    return rm.Lookup(walk_s, ratio, matched, matched if any_matched is None else any_matched)


def test_a_refused_request_is_a_failure_outcome_and_still_a_decision() -> None:
    smg, vr = rm.RouterMetrics("sglang"), rm.RouterMetrics("vllm-router")
    for m in (smg, vr):
        m.observe(rm.Routed("w0", True, lookup(True)))
        m.observe(rm.Routed("w0", False, lookup(False)))
    got = samples(smg.render({"w0": True}))
    assert got['smg_worker_cb_outcomes_total{worker="w0",outcome="success"}'] == 1
    assert got['smg_worker_cb_outcomes_total{worker="w0",outcome="failure"}'] == 1
    assert samples(vr.render({"w0": True}))['vllm_router_policy_decisions_total{policy="cache_aware",worker="w0"}'] == 2


def test_llmd_counts_a_lookup_hit_when_any_pod_held_a_prefix() -> None:
    m = rm.RouterMetrics("llm-d")
    m.observe(rm.Routed("w0", True, lookup(False, any_matched=True)))  # the pick was not the best candidate
    m.observe(rm.Routed("w1", True, lookup(False)))
    got = samples(m.render({}))
    assert got["llm_d_epp_kv_cache_index_lookup_requests_total"] == 2
    assert got["llm_d_epp_kv_cache_index_lookup_hits_total"] == 1


def test_dynamo_reports_walks_in_milliseconds_on_its_own_buckets() -> None:
    m = rm.RouterMetrics("dynamo")
    for walk in (2e-5, 2e-5, 0.008):  # 0.02 ms, 0.02 ms, 8 ms
        m.observe(rm.Routed("w0", True, lookup(True, walk_s=walk, ratio=0.5)))
    got = samples(m.render({"w0": True}))
    name = "dynamo_router_overhead_indexer_find_matches_ms"
    assert got[f'{name}_bucket{{router_id="1",le="0.01"}}'] == 0
    assert got[f'{name}_bucket{{router_id="1",le="0.03"}}'] == 2
    assert got[f'{name}_bucket{{router_id="1",le="7.29"}}'] == 2
    assert got[f'{name}_bucket{{router_id="1",le="21.87"}}'] == 3
    assert got[f'{name}_count{{router_id="1"}}'] == 3 and abs(got[f'{name}_sum{{router_id="1"}}'] - 8.04) < 1e-9
    ratio = 'dynamo_component_router_kv_hit_rate_bucket{dynamo_namespace="sim",dynamo_component="router",router_id="1",'
    assert got[ratio + 'le="0.45"}'] == 0 and got[ratio + 'le="0.5"}'] == 3  # "≤ bound"
    assert not any("worker" in s for s in got)  # Dynamo has no per-worker decision or health series


def test_unlabelled_series_exist_from_the_start_and_labelled_ones_once_used() -> None:
    assert samples(rm.RouterMetrics("sglang-legacy").render({"w0": True})) == {
        "sgl_router_cache_hits_total": 0, "sgl_router_cache_misses_total": 0}
    got = samples(rm.RouterMetrics("sglang").render({"w0": True, "w1": False}))
    assert got['smg_worker_health{worker="w0"}'] == 1 and got['smg_worker_health{worker="w1"}'] == 0
    assert not any(s.startswith(("smg_worker_cb_outcomes_total", "smg_cache_aware_policy_branch_total")) for s in got)
    assert got["smg_cache_aware_match_ratio_count"] == 0


def test_a_round_robin_router_exports_decisions_but_no_prefix_series() -> None:
    topology = load_topology(None).with_workers(3)
    metrics = rm.RouterMetrics("vllm-router")
    sim = Simulation(load_preset("healthy"), topology, policy="round-robin", duration_s=60, router_metrics=metrics)
    result = sim.run()
    got = samples(sim.router.metrics_page(lambda w: f"http://{w}:8000"))
    truth = Counter(r["worker"] for r in result.records)
    assert {s: v for s, v in got.items() if s.startswith("vllm_router_policy_decisions_total")} == {
        f'vllm_router_policy_decisions_total{{policy="round_robin",worker="http://{w}:8000"}}': n
        for w, n in truth.items()}
    assert not any(s.startswith("vllm_router_prefix_routing_decisions_total") for s in got)
    assert all(got[f'vllm_router_worker_health{{worker="http://{w}:8000"}}'] == 1 for w in topology.names)
    assert not metrics.totals  # no index walked, nothing predicted


# ---- the SGLang gateway's tree gauges ------------------------------------------------------------
def tree_lookup(chars: int, at: float, model: str = "m") -> rm.Lookup:
    return rm.Lookup(1e-4, 0.0, False, False, new_chars=chars, model=model, at=at)


def test_the_tree_gauges_appear_at_the_first_eviction_pass_and_count_each_tenant() -> None:
    m = rm.RouterMetrics("sglang")
    m.observe(rm.Routed("w0", True, tree_lookup(1000, at=0.0)))
    m.observe(rm.Routed("w1", True, tree_lookup(1000, at=10.0)))  # the same prompt on a second worker: twice
    assert not any("cache_tree" in s for s in samples(m.render({"w0": True, "w1": True})))
    m.observe(rm.Routed("w0", True, tree_lookup(500, at=rm.SMG_EVICTION_INTERVAL_S + 1)))  # after the pass
    got = samples(m.render({"w0": True, "w1": True}))
    assert got['smg_cache_tree_chars{model="m"}'] == 2000  # the pass reports what it found; 500 came after
    assert got['smg_cache_tree_tokens{model="m"}'] == 0  # in front of HTTP workers the token tree stays empty


def test_an_eviction_pass_trims_a_model_s_tree_to_its_bound() -> None:
    tree = rm.TreeSize(max_size=1000, interval_s=60.0)
    tree.insert("m", "w0", 900, at=0.0)
    tree.insert("m", "w1", 600, at=1.0)
    tree.insert("other", "w0", 10, at=2.0)
    tree.advance(60.0)
    assert tree.reported["m"] <= 1000 and tree.reported["m"] >= 998  # whole characters per tenant
    assert tree.chars["m"]["w0"] > tree.chars["m"]["w1"]  # each tenant trimmed, none emptied
    assert tree.reported["other"] == 10
    tree.advance(600.0)
    assert tree.passes == 10


def test_a_simulated_gateway_reports_its_tree_and_the_exporter_reads_its_fill() -> None:
    topology = load_topology(None).with_workers(3)
    metrics = rm.RouterMetrics("sglang")
    sim = Simulation(load_preset("healthy"), topology, duration_s=300, router_metrics=metrics)
    result = sim.run()
    page = sim.router.metrics_page(lambda w: f"http://{w}:8000")
    got = samples(page)
    chars = got[f'smg_cache_tree_chars{{model="{topology.model}"}}']
    # at most every prompt's characters, at least the longest prompt's
    assert max(r["prompt_tokens"] for r in result.records) <= chars <= sum(r["prompt_tokens"] for r in result.records)
    snap, errors = parse_router("gateway", page)
    assert errors == [] and snap.kind == "sglang-router"
    assert snap.largest_tree == chars and snap.tree_bound == rm.SMG_MAX_TREE_SIZE
    # a policy that walks no tree reports none
    rr = rm.RouterMetrics("sglang")
    Simulation(load_preset("healthy"), topology, policy="round-robin", duration_s=300, router_metrics=rr).run()
    assert "cache_tree" not in rr.render({w: True for w in topology.names}, "round-robin", prefix_aware=False)
