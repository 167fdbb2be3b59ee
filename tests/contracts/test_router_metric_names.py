"""The simulated router's /metrics names against the exporter's router adapters.

The fleet keeps its own table of the real routers' names (``fleet/router_metrics.py``; it may not
import the exporter). Every name a flavour emits is one its adapter reads, every signal the table
says a flavour carries is filled in when the adapter reads the flavour's page, and every name an
adapter reads is emitted by some flavour — except the alternative spellings listed here, each an
older or parallel name of a signal a simulated flavour already carries.
"""

from __future__ import annotations

import pytest

from exporter.codecs import normalize, routers
from exporter.codecs.routers import dynamo, sglang, vllm_router
from exporter.codecs.routers.common import histogram_names
from fleet import router_metrics as rm
from prefixscope import catalog

# Names the adapters read that no simulated flavour emits, and why that is fine.
NOT_SIMULATED: dict[str, str] = {
    sglang.SMG_SENDS: "smg >= 1.13's per-send count; decisions are simulated as smg's circuit-breaker outcomes",
    **{f"{sglang.SMG_LOOKUP}{s}": "smg's KV-index lookup, timed only with KV-event-fed routing (gRPC workers); "
       "the simulated router is smg in front of HTTP workers" for s in ("_bucket", "_sum", "_count")},
    sglang.SGL_WORKER_REQUESTS: "SGLang's in-tree experimental router; decisions are simulated as smg and sgl_router",
    sglang.SGL_CACHE_DECISIONS: "SGLang's in-tree experimental router; outcomes are simulated as smg and sgl_router",
    vllm_router.VR_HITS: "vllm-router's unlabelled cache-aware counters; outcomes are simulated as the 0.1.17 series",
    vllm_router.VR_MISSES: "as above",
    **{n: "Dynamo's name before the dynamo_router_ prefix; the latency is simulated under the current name"
       for n in (f"{dynamo.FIND_MATCHES_MS_OLD}{s}" for s in ("_bucket", "_sum", "_count"))},
    sglang.SMG_MANUAL: "smg's sticky policy; the real smg 1.13.0 drives it (tests/e2e/test_smg_policies.py)",
    sglang.SMG_PREFIX_HASH: "smg's prefix-hash policy; the real smg 1.13.0 drives it (tests/e2e/test_smg_policies.py)",
    sglang.SMG_KV_GAPS: "smg's KV-event health, kept only with KV-event-fed routing (gRPC workers); the simulated "
                        "router is smg in front of HTTP workers",
    sglang.SMG_KV_RESYNCS: "as above",
    **{f"{sglang.SMG_KV_LAG}{s}": "as above" for s in ("_bucket", "_sum", "_count")},
    dynamo.NON_MAX_OVERLAP: "Dynamo's routing regret (prefill picks); the simulated router routes aggregated",
    **{f"{dynamo.BLOCKS_LOST}{s}": "as above" for s in ("_bucket", "_sum", "_count")},
    dynamo.REQUESTS: "Dynamo's request count, read as regret's denominator; regret is not simulated",
    dynamo.EVENTS_APPLIED: "Dynamo's index apply statuses; the simulated router keeps no KV-event-fed index",
    "sgl_router_tree_size": "sglang-router <= 0.2.4's per-worker tree size; the tree is simulated as smg's",
    **{n: "Dynamo's routing phases besides the index lookup (and every phase's former name); the simulated "
          "router times only the lookup (tests/fixtures/routers/dynamo_router_overhead.txt has them all)"
       for phase, names in dynamo.PHASE_NAMES.items() for name in names for n in histogram_names(name)
       if name != dynamo.FIND_MATCHES_MS and name != dynamo.FIND_MATCHES_MS_OLD},
    sglang.SMG_ENGINE_HIT_RATE: "the engines' hit rate the gateway polls from gRPC SGLang workers; the simulated "
                                "router is smg in front of HTTP workers",
    vllm_router.VR_TREE_SIZE: "vllm-router's tree size: named in its source, never set by the 0.1.17 wheel",
}

# RouterSnapshot field -> the catalogue series it feeds (the matrix in docs/routers.md).
FEEDS = {"decisions": "router_decisions", "prefix_outcomes": "router_prefix_outcomes",
         "healthy": "router_worker_healthy", "predicted_hit_ratio": "router_predicted_hit_ratio",
         "lookup_seconds": "router_tree_walk_seconds", "largest_tree": "router_tree_fill_ratio"}


def busy_page(flavour: str) -> str:
    """A page with every series of the flavour present (a hit, a miss, a refusal, an unhealthy worker;
    the last decision after the router's first tree eviction pass)."""
    m = rm.RouterMetrics(flavour)
    for i, (worker, matched) in enumerate((("w0", True), ("w1", False), ("w0", True))):
        m.observe(rm.Routed(worker, accepted=i != 2,
                            lookup=rm.Lookup(0.002, 0.5 if matched else 0.0, matched, matched or i == 1,
                                             new_chars=100, at=i * 0.6 * rm.SMG_EVICTION_INTERVAL_S)))
    return m.render({"w0": True, "w1": False}, "prefix-tree", lambda w: f"http://10.0.0.{w[1:]}:8000")


@pytest.mark.parametrize("flavour", sorted(rm.FLAVOURS))
def test_every_name_a_flavour_emits_is_one_its_adapter_reads(flavour: str) -> None:
    adapter = routers.BY_KIND[rm.FLAVOURS[flavour].adapter]
    assert rm.names_of(flavour) <= adapter.names
    assert adapter.matches(rm.names_of(flavour))


@pytest.mark.parametrize("flavour", sorted(rm.FLAVOURS))
def test_every_signal_a_flavour_carries_is_read_from_its_page(flavour: str) -> None:
    kind = rm.FLAVOURS[flavour].adapter
    snap, errors = normalize.parse_router("r", busy_page(flavour))  # kind: auto
    assert errors == [] and snap.kind == kind
    carried = {s.signal for s in rm.series_of(flavour)}
    for fld, series in FEEDS.items():
        assert bool(getattr(snap, fld)) == (fld in carried), (flavour, fld)
        # the table and the catalogue's router matrix agree on what this router can feed
        if fld in carried:
            assert catalog.ROUTER_FEEDS[f"{catalog.NAMESPACE}_{series}"][kind] is not None, (flavour, fld)


def test_every_name_an_adapter_reads_is_emitted_by_some_flavour() -> None:
    for adapter in routers.ADAPTERS:
        emitted = frozenset().union(*(rm.names_of(f) for f, fl in rm.FLAVOURS.items() if fl.adapter == adapter.kind))
        assert emitted, f"no simulated flavour speaks {adapter.kind}"
        assert adapter.names - emitted == {n for n in NOT_SIMULATED if n in adapter.names}, adapter.kind


def test_the_simulated_gateway_bounds_its_tree_where_the_exporter_expects_it() -> None:
    assert rm.SMG_MAX_TREE_SIZE == sglang.DEFAULT_MAX_TREE_SIZE


def test_every_simulated_flavour_has_an_adapter_and_none_is_a_choice() -> None:
    assert {f.adapter for f in rm.FLAVOURS.values()} == set(catalog.ROUTER_KINDS)
    assert rm.CHOICES[-1] == rm.NONE and rm.RouterMetrics(rm.NONE).render({"w0": True}) == ""
    with pytest.raises(ValueError, match="unknown router_metrics flavour"):
        rm.RouterMetrics("nginx")


def test_the_table_rows_are_well_formed() -> None:
    for s in rm.SERIES:
        assert s.type in ("counter", "gauge", "histogram") and s.help
        assert (s.type == "histogram") == (s.value in rm.HISTOGRAMS) == bool(s.buckets)
        assert s.type != "counter" or s.name.endswith("_total")
        assert (s.value in rm.PER_WORKER) == any(lb.value == rm.WORKER for lb in s.labels)
        assert list(s.buckets) == sorted(set(s.buckets))
