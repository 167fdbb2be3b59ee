"""vLLM's sampled block residency (``--kv-cache-metrics``) in the simulated fleet: what the cache
observes on the simulated clock, how a worker's /metrics carries it (vLLM's names, labels and
buckets, as the fixture of vLLM 0.14 has them), that it is absent without the flag, and that the
exporter reads it from a fleet worker served on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.bootstrap import bootstrap
from exporter.codecs.normalize import V_RESIDENCY, parse_worker
from exporter.config import Config, WorkerTarget
from exporter.web.exposition import render_state
from fleet.cache import PagedPrefixCache
from fleet.cli import parse_args
from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, SimEngine, WorkerSpec
from fleet.metrics_text import render_metrics
from fleet.residency import RESIDENCY_BUCKETS, ResidencySampler
from fleet.scenarios import load_preset
from fleet.simulation import KV_CACHE_METRICS, KV_CACHE_METRICS_SAMPLE, Simulation, worker_spec
from fleet.topology import load_topology
from fleet.workers import WorkerFleet

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_0_14_kv_residency.txt"
FAMILIES = tuple(V_RESIDENCY.values())


# ---- the cache's observations ------------------------------------------------------------------
def test_an_evicted_block_reports_its_lifetime_idle_time_and_reuse_gaps() -> None:
    sampler = ResidencySampler(1.0)
    c = PagedPrefixCache(3, 1, residency=sampler)
    for rid, at in (("a", 0.0), ("b", 10.0), ("c", 25.0)):  # block 1: allocated at 0, hit at 10 and 25
        c.store(rid, [1], at=at)
        c.release(rid)
    c.store("d", [2, 3], at=30.0)  # fills the cache; nothing evicted yet
    c.release("d")
    h = sampler.histograms
    assert (h.lifetime.count, h.idle_before_evict.count, h.reuse_gap.count) == (0, 0, 0)
    c.store("e", [4], at=40.0)  # needs room: block 1, the least recently used, goes
    assert (h.lifetime.count, h.lifetime.sum) == (1, 40.0)  # allocation to eviction
    assert (h.idle_before_evict.count, h.idle_before_evict.sum) == (1, 15.0)  # last hit (25) to eviction
    assert (h.reuse_gap.count, h.reuse_gap.sum) == (1, 15.0)  # between its two hits; allocation is none
    assert sampler.tracked == 3
    c.release("e")
    c.reset()  # vLLM forgets its samples on a reset, unobserved
    assert sampler.tracked == 0 and h.lifetime.count == 1


def test_idle_time_counts_from_the_last_hit_even_while_a_request_held_the_block() -> None:
    sampler = ResidencySampler(1.0)
    c = PagedPrefixCache(2, 1, residency=sampler)
    c.store("a", [1], at=0.0)
    c.release("a")  # released long after its allocation: vLLM's idle clock started at the access
    c.store("b", [2], at=50.0)
    c.release("b")
    c.store("c", [3], at=60.0)
    assert (sampler.histograms.idle_before_evict.sum, sampler.histograms.lifetime.sum) == (60.0, 60.0)


def test_a_share_of_blocks_is_sampled_reproducibly() -> None:
    def tracked(seed: int) -> set[int]:
        s = ResidencySampler(0.25, seed=seed)
        for h in range(4000):
            s.allocated(h, 0.0)
        return set(s._blocks)

    first = tracked(7)
    assert 800 < len(first) < 1200
    assert tracked(7) == first and tracked(8) != first
    with pytest.raises(ValueError):
        ResidencySampler(0.0)


# ---- a worker's /metrics -----------------------------------------------------------------------
def evicting_engine(**kw) -> tuple[SimEngine, VirtualClock]:
    """A worker whose small cache evicts: each request brings 4 new blocks into room for 10; a head
    block shared by the first twelve is hit eleven times, then evicted by four unrelated prompts."""
    clock = VirtualClock()
    eng = SimEngine(WorkerSpec("w0", model="org/model-7b", block_size=4, num_gpu_blocks=10, **kw), clock)
    shared = [1, 2, 3, 4]
    prompts = [shared + [100 * i + j for j in range(13)] for i in range(12)]
    prompts += [[5000 + 100 * i + j for j in range(17)] for i in range(4)]
    for i, prompt in enumerate(prompts):
        r = eng.execute(EngineRequest(f"r{i}", token_ids=prompt, max_tokens=2))
        clock.advance(r.e2e_s + 5.0)
        eng.tick()
    return eng, clock


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_page_carries_vllms_residency_histograms_in_its_names_labels_and_buckets() -> None:
    eng, _ = evicting_engine(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    text = render_metrics(eng, "vllm").decode()
    ours, vllm = families(text), families(FIXTURE.read_text())
    for name in FAMILIES:
        assert ours[name].type == vllm[name].type == "histogram"
        assert ours[name].documentation == vllm[name].documentation
        mine = [s for s in ours[name].samples if s.name.endswith("_bucket")]
        theirs = [s for s in vllm[name].samples if s.name.endswith("_bucket") and s.labels["engine"] == "0"]
        assert [s.labels["le"] for s in mine] == [s.labels["le"] for s in theirs]
        assert {k for s in ours[name].samples for k in s.labels} == {k for s in vllm[name].samples for k in s.labels}
        assert {s.name.removeprefix(name) for s in ours[name].samples} == \
            {s.name.removeprefix(name) for s in vllm[name].samples}
    # the exporter's own parser reads them, with the engine's counts
    snap, errors = parse_worker("w0", text)
    assert errors == []
    assert snap.residency is not None and set(snap.residency) == {"lifetime", "idle_before_evict", "reuse_gap"}
    h = eng.cache.residency.histograms
    assert snap.residency["idle_before_evict"].count == h.idle_before_evict.count > 0
    assert snap.residency["lifetime"].sum == pytest.approx(h.lifetime.sum)
    assert snap.residency["reuse_gap"].count == h.reuse_gap.count > 0  # the shared head is hit again and again
    assert snap.residency["lifetime"].bounds[:-1] == RESIDENCY_BUCKETS


def test_before_any_eviction_the_histograms_are_there_and_empty() -> None:
    eng = SimEngine(WorkerSpec("w0", kv_cache_metrics=True), VirtualClock())
    snap, _ = parse_worker("w0", render_metrics(eng, "vllm").decode())
    assert snap.residency is not None and all(h.count == 0 for h in snap.residency.values())


@pytest.mark.parametrize("flavour", ["vllm", "vllm-legacy", "sglang"])
def test_without_the_flag_the_series_are_absent_not_zero(flavour: str) -> None:
    eng, _ = evicting_engine()
    assert eng.cache.residency is None
    text = render_metrics(eng, flavour).decode()
    assert "kv_block_" not in text
    if flavour != "sglang":
        snap, _ = parse_worker("w0", text)
        assert snap.residency is None


def test_the_pre_0_9_2_names_never_carry_them() -> None:
    """--kv-cache-metrics came with vLLM 0.14: a page in the old names has no residency."""
    eng, _ = evicting_engine(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    assert "kv_block_" not in render_metrics(eng, "vllm-legacy").decode()


def test_the_flag_is_a_worker_option_at_vllms_default_sample() -> None:
    """On where asked for (``prefixscope sim`` and the demo's fleet: tests/fleet/test_sim_cli.py), off
    in the simulations that read the presets' verdicts (see KV_CACHE_METRICS)."""
    topology = load_topology()
    assert not KV_CACHE_METRICS and not worker_spec(topology, topology.workers[0]).kv_cache_metrics
    spec = worker_spec(topology, topology.workers[0], kv_cache_metrics=True)
    assert spec.kv_cache_metrics and spec.kv_cache_metrics_sample == KV_CACHE_METRICS_SAMPLE == 0.01
    assert parse_args([]).kv_cache_metrics and not parse_args(["--no-kv-cache-metrics"]).kv_cache_metrics


def test_a_reset_cache_and_a_restarted_engine_start_their_samples_afresh() -> None:
    eng, _ = evicting_engine(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    before = eng.cache.residency.histograms.lifetime.count
    eng.reset_cache()
    assert eng.cache.residency.tracked == 0
    assert eng.cache.residency.histograms.lifetime.count == before  # what was observed stays (a counter)


def test_cache_pressure_evicts_with_a_retention_far_above_the_threshold() -> None:
    """The preset whose cache thrashes evicts enough for the 1 % sample to read its retention, and
    what it reads is minutes: PrefixCacheRetentionShort (30 s) is not this fault's alert."""
    sc = load_preset("cache-pressure")
    sim = Simulation(sc, load_topology(), kv_cache_metrics=True)
    sim.run()
    h = sim.engines["w0"].cache.residency.histograms.idle_before_evict
    assert h.count >= 100
    within_30s = h.cumulative()[RESIDENCY_BUCKETS.index(30.0)][1]
    assert within_30s < h.count / 2


# ---- the exporter reads them from a fleet worker ---------------------------------------------------
@pytest.fixture()
def fleet() -> Iterator[tuple[WorkerFleet, VirtualClock]]:
    clock = VirtualClock()
    specs = [WorkerSpec("w0", block_size=4, num_gpu_blocks=10, kv_cache_metrics=True, kv_cache_metrics_sample=1.0),
             WorkerSpec("w1", block_size=4, num_gpu_blocks=10)]
    with WorkerFleet(specs, clock=clock) as f:
        yield f, clock


def test_the_exporter_reads_the_residency_of_a_fleet_worker_and_nothing_for_one_without_the_flag(fleet) -> None:
    f, clock = fleet
    now = [1000.0]
    cfg = Config(workers=tuple(WorkerTarget(w.name, metrics_url=f"{w.url}/metrics") for w in f))
    parts = bootstrap(cfg, clock=lambda: now[0], with_sources=True)
    assert parts.sources is not None
    scraper = parts.sources.scraper
    try:
        assert all(o.up for o in scraper.scrape_once())
        for name in ("w0", "w1"):  # the same traffic on both: the shared head stays, the rest is evicted
            eng = f[name].engine
            for i in range(12):
                eng.execute(EngineRequest(f"{name}-{i}", token_ids=[1, 2, 3, 4] + [100 * i + j for j in range(13)],
                                          max_tokens=2))
                clock.advance(2.0)
                eng.tick()
        now[0] += 60.0
        assert all(o.up for o in scraper.scrape_once())
        body = requests.get(f"{f['w0'].url}/metrics", timeout=10).text
        assert "vllm:kv_block_idle_before_evict_seconds_bucket" in body
        assert "kv_block_" not in requests.get(f"{f['w1'].url}/metrics", timeout=10).text
        exported = {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(render_state(parts.state).decode()) for s in fam.samples}
        h = f["w0"].engine.cache.residency.histograms
        idle = "prefixscope_kv_block_idle_before_evict_seconds"
        assert exported[(f"{idle}_count", (("worker", "w0"),))] == h.idle_before_evict.count > 0
        assert exported[("prefixscope_kv_block_lifetime_seconds_count", (("worker", "w0"),))] == h.lifetime.count
        assert not [k for k in exported if k[0].startswith(("prefixscope_kv_block_lifetime",
                                                             "prefixscope_kv_block_idle", "prefixscope_kv_block_reuse"))
                    and ("worker", "w1") in k[1]]
        assert exported[("prefixscope_signal_available", (("signal", "kv_residency"),))] == 1
    finally:
        scraper.close()
