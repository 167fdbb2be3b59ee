"""Workers that service discovery drops and adds, in the state: a departure is at once out of the
pool and the index, with no gauge left to read it as down or stale; its counters retire after
``label_idle``; a worker that comes back is one again."""

from __future__ import annotations

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import Limits, WorkerSnapshot
from prefixscope.thresholds import load_thresholds

UP = "prefixscope_up"


def scrape(st: ClusterState, worker: str, ts: float, hits: float) -> None:
    st.health.set(UP, (worker, "worker"), 1.0)
    st.observe_worker(WorkerSnapshot(worker, "vllm", model="m", prefix_queried_tokens=hits * 2,
                                     prefix_hit_tokens=hits), ts)


def series_of(st: ClusterState, worker: str) -> list[str]:
    s = st.snapshot_for(lambda s: s.series())
    return [name for kind in (s.counters, s.gauges) for name, by in kind.items()
            for labels in by if worker in labels]


def test_a_departed_worker_leaves_at_once_and_its_series_retire_after_label_idle() -> None:
    st = ClusterState.build(Health(), load_thresholds(), window_s=300, health_recency_s=60,
                      limits=Limits(label_idle=900.0))
    for ts in (0.0, 70.0, 140.0):  # past the discovery phase: pool changes count
        scrape(st, "w0", ts, ts)
        scrape(st, "w1", ts, ts)
    assert st.worker_pool.pool == {"w0", "w1"} and series_of(st, "w1")
    changes = st.worker_pool.epoch
    st.membership.left(["w1"])
    assert st.worker_pool.pool == {"w0"} and st.worker_pool.epoch == changes + 1
    assert (("w1", "worker")) not in st.health.gauges.get(UP, {})
    assert st.worker_pool.liveness("w1") == "left" and st.worker_pool.blind_targets() == 0
    assert any(n.startswith("prefixscope_prefix_cache") for n in series_of(st, "w1"))  # counters stay a while
    scrape(st, "w0", 140.0 + 899.0, 1000.0)
    assert series_of(st, "w1")
    scrape(st, "w0", 140.0 + 900.0, 1100.0)
    assert series_of(st, "w1") == [] and "w1" not in st.worker_pool.workers

    st.membership.joined(["w1"])  # it comes back under the same name
    scrape(st, "w1", 1100.0, 5.0)
    scrape(st, "w0", 1100.0, 1200.0)
    assert st.worker_pool.pool == {"w0", "w1"}
