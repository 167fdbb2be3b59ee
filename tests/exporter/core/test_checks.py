"""Check statuses and the diagnosis verdict on crafted windows."""

import pytest

from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import WorkerSnapshot
from prefixscope.thresholds import load_thresholds


def make() -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), window_s=300, clock=lambda: 200.0)


def scrape(st, t, queried, hits):
    st.observe_worker(WorkerSnapshot("w0", "vllm", model="m", prefix_queried_tokens=queried,
                                     prefix_hit_tokens=hits), t)


def test_missing_signals_are_not_instrumented_never_zero():
    ev = evaluate(make())
    assert ev.verdict is None
    r = ev.results["sticky_session_collision_rate"]
    assert r.status == "not_instrumented" and r.value is None and r.missing_signals == ["affinity_outcomes"]


def test_healthy_window_has_no_verdict():
    st = make()
    scrape(st, 100, 1000, 900)
    scrape(st, 110, 2000, 1800)  # window: 900 of 1000 hit
    ev = evaluate(st)
    assert ev.results["prefix_hit_rate_total"].value == 0.9
    assert ev.results["prefix_hit_rate_total"].status == "ok"
    assert ev.verdict is None


def test_falling_hit_rate_with_step2_cause_names_step2():
    st = make()
    scrape(st, 100, 1000, 900)
    scrape(st, 110, 2000, 1200)  # 30% hit: the symptom fires
    recs = [{"ts": 110 + i, "request_id": f"r{i}", "worker": "w0" if i % 2 else "w1", "prompt_tokens": 10,
             "session_key": "s"} for i in range(4)]  # every follow-up switches healthy workers
    st.ingest_records(recs, 115)
    ev = evaluate(st)
    assert ev.results["prefix_hit_rate_total"].status == "firing"
    assert ev.results["sticky_session_collision_rate"].value == 1.0
    # The symptom starts the walk but colours no step: of step 1's causes only the per-worker
    # outlier reads engine metrics alone, and a lone worker is its own median.
    assert ev.results["prefix_hit_rate_worker_outlier"].value == 1.0
    assert ev.step_status[1] == "ok"
    assert ev.verdict == {"step": 2, "title": "Affinity", "checks": ["sticky_session_collision_rate"]}


def test_the_shard_plan_is_exported_and_judged_only_where_every_shard_is_seen():
    """One exporter knows no shard is missing; one shard of three cannot tell whether its peers run
    (not instrumented, never 0 and never firing); the three read together (as Prometheus reads their
    series) miss none."""
    from exporter.core.sharding import ShardSpec
    from exporter.core.state_parts import build_parts
    from tests.scale.shards_as_one import ShardsAsOne

    one = make()
    assert one.series().gauges["prefixscope_exporter_shards"] == {("0",): 1.0}
    r = evaluate(one).results["exporter_shards"]
    assert (r.value, r.status) == (0.0, "ok")

    shards = [ClusterState(build_parts(Health(), load_thresholds(), window_s=300, clock=lambda: 200.0,
                                       shard=ShardSpec(i, 3))) for i in range(3)]
    assert shards[1].series().gauges["prefixscope_exporter_shards"] == {("1",): 3.0}
    r = evaluate(shards[1]).results["exporter_shards"]
    assert (r.value, r.status) == (None, "not_instrumented")
    r = evaluate(ShardsAsOne(shards)).results["exporter_shards"]  # type: ignore[arg-type]
    assert (r.value, r.status) == (0.0, "ok")
    r = evaluate(ShardsAsOne(shards[:2])).results["exporter_shards"]  # type: ignore[arg-type]
    assert (r.value, r.status) == (1.0, "firing")


def test_the_share_of_silent_kv_streams_is_evaluated_as_the_rule_has_it():
    """PrefixTelemetryFleetBlind: the share of streamed workers silent past the staleness threshold
    (120 s), not "no data"."""
    from exporter.model import BlockStored, KvBatch
    now = [1000.0]
    st = ClusterState.build(Health(), load_thresholds(), window_s=300, clock=lambda: now[0])
    for i, t in enumerate((700.0, 990.0, 995.0, 999.0)):  # w0 silent for 300 s, the others fresh
        st.apply_kv_batch(KvBatch(f"w{i}", 0, t, (BlockStored((i + 1,), None, 16),)), t)
    r = evaluate(st).results["kv_event_blind_share"]
    assert r.value == 0.25 and r.status == "ok"  # alerts above a quarter
    now[0] = 1200.0  # all four silent past 120 s
    r = evaluate(st).results["kv_event_blind_share"]
    assert r.value == 1.0 and r.status == "firing"


def test_one_wiped_worker_among_healthy_ones_names_step_1_and_that_worker():
    """As the rule (tests/alerts/test_promtool.py): twelve workers with the same traffic, one at a
    0.13 hit ratio among 0.94: the cluster reads 0.8725 (no symptom), the worker is 0.138 × its
    peers' median, the verdict is step 1 and the culprit that worker."""
    from exporter.core.culprits import Culprits
    now = [0.0]
    st = ClusterState.build(Health(), load_thresholds(), window_s=300, clock=lambda: now[0])
    for minute in range(11):
        now[0] = 60.0 * minute
        for i in range(12):
            hit = 0.13 if i == 11 else 0.94
            st.observe_worker(WorkerSnapshot(f"w{i}", "vllm", model="m", prefix_queried_tokens=600 * minute,
                                             prefix_hit_tokens=round(600 * hit * minute)), now[0])
    ev = evaluate(st)
    assert ev.results["prefix_hit_rate_total"].value == pytest.approx(0.8725, abs=1e-3)
    assert ev.results["prefix_hit_rate_total"].status == "ok"
    outlier = ev.results["prefix_hit_rate_worker_outlier"]
    assert outlier.value == pytest.approx(0.13 / 0.94, abs=1e-3) and outlier.status == "firing"
    assert ev.verdict == {"step": 1, "title": "Cache", "checks": ["prefix_hit_rate_worker_outlier"]}
    workers = st.snapshot_for(lambda s: Culprits(s).of(outlier.check))["workers"]
    assert workers[0]["worker"] == "w11" and workers[0]["value"] == pytest.approx(0.13 / 0.94, abs=1e-3)
    assert workers[0]["unit"] == "ratio_to_peers"
