"""What one scrape adds: a worker's engine counters (prefix cache, speculative decoding, KV
connector, cache tiers) and histograms (vLLM's sampled block residency, LMCache's times) scrape over
scrape, a router's histograms, and the readings built on a worker's counters (its hit ratio and hit
tokens in the window, its effective cache value).

A counter that went down was reset (an engine restart): its new value is the increase. The first
scrape of a router is its baseline: what it counted before is not in the window. A series whose
label values the worker's page stopped reporting (a model it no longer serves, a tier it no
longer counts) is dropped once that worker's scrapes have left it out for ``idle_s``; a worker
that is not scraped at all keeps its series (missing signal is not a value gone).

The parts are handed in, as for ``exporter.core.record_accounting``; not thread-safe on its own:
``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import itemgetter

from exporter.core.index.prefix_index import PrefixIndex
from exporter.core.metric_store import MetricStore
from exporter.core.record_accounting import UNKNOWN
from exporter.core.windows import increase
from exporter.core.worker_pool import DEFAULT_BLOCK_SIZE, WorkerPool
from exporter.model import RouterSnapshot, WorkerSnapshot
from prefixscope import catalog

P = catalog.NAMESPACE

# WorkerSnapshot counter field -> catalogue counter it is exported as (labels worker, model).
SNAPSHOT_COUNTERS: dict[str, str] = {
    "prefix_queried_tokens": f"{P}_prefix_cache_queried_tokens",
    "prefix_hit_tokens": f"{P}_prefix_cache_hit_tokens",
    "spec_draft_tokens": f"{P}_spec_decode_draft_tokens",
    "spec_accepted_tokens": f"{P}_spec_decode_accepted_tokens",
    "external_queried_tokens": f"{P}_external_prefix_cache_queried_tokens",
    "external_hit_tokens": f"{P}_external_prefix_cache_hit_tokens",
    "lmcache_lookup_tokens": f"{P}_lmcache_lookup_queried_tokens",
    "lmcache_lookup_hit_tokens": f"{P}_lmcache_lookup_hit_tokens",
}
TIER_HITS = f"{P}_prefix_cache_tier_hit_tokens"  # labels worker, model, tier


def _m(name: str) -> str:
    return catalog.METRICS_BY_NAME[f"{P}_{name}"].name


# RouterSnapshot histogram -> the catalogue histogram it feeds, the signal it instruments, its labels.
ROUTER_HISTOGRAMS: tuple[tuple[str, str, str, Callable[[RouterSnapshot], tuple[str, ...]]], ...] = (
    ("lookup_seconds", _m("router_tree_walk_seconds"), "walk_latency", lambda _snap: ()),
    ("predicted_hit_ratio", _m("router_predicted_hit_ratio"), "router_predicted_reuse", lambda snap: (snap.router,)),
    ("kv_event_lag_seconds", _m("router_kv_event_lag_seconds"), "router_index_health", lambda snap: (snap.router,)),
)
_OVERHEAD = _m("router_overhead_seconds")  # labels router, phase
# WorkerSnapshot histograms -> (key -> the catalogue histogram it feeds), the signal it instruments
# (None: no check reads it), and whether the key is the series' label beside the worker.
WORKER_HISTOGRAMS: tuple[tuple[str, dict[str, str], str | None, bool], ...] = (
    ("residency", {"lifetime": _m("kv_block_lifetime_seconds"),
                   "idle_before_evict": _m("kv_block_idle_before_evict_seconds"),
                   "reuse_gap": _m("kv_block_reuse_gap_seconds")}, "kv_residency", False),
    ("lmcache_seconds", dict.fromkeys(catalog.LMCACHE_OPERATIONS, _m("lmcache_operation_seconds")), None, True),
)
_STICKY_FOLLOWUPS = _m("router_sticky_followups")
_INDEX_FAULTS = _m("router_kv_index_faults")
# RouterSnapshot running total -> the catalogue counter it is exported as (label: router)
ROUTER_TOTALS: dict[str, str] = {
    "regret_selections": _m("router_regret_selections"),
    "regret_blocks": _m("router_regret_blocks"),
    "routed_requests": _m("router_routed_requests"),
}


def router_counters(snap: RouterSnapshot) -> dict[tuple[str, tuple[str, ...]], tuple[float, str | None]]:
    """The router's running totals as catalogue counters: (metric, labels) -> (total, the signal it
    instruments, if any)."""
    r = snap.router
    out: dict[tuple[str, tuple[str, ...]], tuple[float, str | None]] = {}
    for (policy, outcome), v in snap.sticky_followups.items():
        out[(_STICKY_FOLLOWUPS, (r, policy, outcome))] = (v, "affinity_outcomes")
    for kind, v in snap.index_faults.items():
        out[(_INDEX_FAULTS, (r, kind))] = (v, "router_index_health")
    for fld, metric in ROUTER_TOTALS.items():
        v = getattr(snap, fld)
        if v is not None:
            out[(metric, (r,))] = (v, None)
    return out


class ScrapeAccounting:
    """Applies worker and router scrapes to the metric store and the worker pool."""

    def __init__(self, store: MetricStore, pool: WorkerPool, index: PrefixIndex,
                 field_seen: dict[str, float], idle_s: float = math.inf) -> None:
        """``field_seen``: signal -> newest input that carried it (the record accounting's, which
        a router's histograms also instrument); ``idle_s``: how long a worker's scrapes may leave
        out one of its series before it is dropped (``limits.label_idle``, never under the window)."""
        self.idle_s = idle_s
        self.store = store
        self.pool = pool
        self.index = index
        self.field_seen = field_seen
        self.spec_seen = False  # a worker reported speculative decoding

    def worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> float | None:
        """A worker's scrape; returns its previous prefix-cache query count (None on its first)."""
        w = self.pool.worker(snapshot.worker, scraped_at)
        previous = w.snapshot
        w.snapshot, w.scraped_at = snapshot, scraped_at
        if snapshot.block_size:
            w.block_size = snapshot.block_size
        model = snapshot.model or UNKNOWN
        prev_queries = w.last_counters.get("prefix_queried_tokens")
        counters = [(fld, metric, (snapshot.worker, model), getattr(snapshot, fld))
                    for fld, metric in SNAPSHOT_COUNTERS.items()]
        counters += [(f"tier:{tier}", TIER_HITS, (snapshot.worker, model, tier), value)
                     for tier, value in (snapshot.tier_hit_tokens or {}).items()]
        reported = w.reported
        for fld, metric, labels, value in counters:
            if value is None:
                continue
            reported[(metric, labels)] = scraped_at
            if fld.startswith("spec_"):
                self.spec_seen = True
            prev = w.last_counters.get(fld)
            # A counter that went down was reset (engine restart): its new value is the increase.
            delta = value if prev is None or value < prev else value - prev
            w.last_counters[fld] = value
            self.store.set_total(metric, labels, value, (scraped_at, delta) if prev is not None else None)
            if prev is not None:
                self.store.add_own(scraped_at, ("worker_delta", fld, snapshot.worker), delta)
        self._worker_histograms(snapshot, previous, scraped_at, reported)
        # (a walk over this worker's few series: a model, the counters, its tiers, its histograms)
        gone = [key for key, ts in reported.items() if scraped_at - ts >= self.idle_s]
        for key in gone:
            del reported[key]
            self.store.drop_series(*key)
        return prev_queries

    def _worker_histograms(self, snap: WorkerSnapshot, previous: WorkerSnapshot | None, ts: float,
                           reported: dict) -> None:
        """The engine's histograms, scrape over scrape: each scrape's new observations placed inside
        the engine's buckets (``windows.increase``); the first scrape is the baseline, its series
        exported empty (the engine reports the histogram; what it counted before is not in the window)."""
        for fld, metrics, signal, keyed in WORKER_HISTOGRAMS:
            new = getattr(snap, fld)
            if not new:
                continue
            if signal is not None:
                self.field_seen[signal] = ts
            old = getattr(previous, fld, None) or {}
            for key, hist in new.items():
                metric = metrics.get(key)
                if metric is None:
                    continue
                labels = (snap.worker, key) if keyed else (snap.worker,)
                reported[(metric, labels)] = ts
                self.store.ensure_histogram(metric, labels)
                before = old.get(key)
                if before is not None:
                    self.store.observe_counts(ts, metric, labels, increase(hist, before))

    def router(self, snap: RouterSnapshot, ts: float) -> None:
        """A router's scrape: its histograms, scrape over scrape (the new observations go into the
        catalogue's histogram, each placed inside its router bucket (``windows.increase``), and the signal is
        instrumented), then the pool's evidence (decisions, health)."""
        prev = self.pool.routers.get(snap.router)
        before = router_counters(prev) if prev is not None else {}
        for (metric, lab), (value, signal) in router_counters(snap).items():
            if signal is not None:
                self.field_seen[signal] = ts
            old = before.get((metric, lab))
            # The first scrape is the baseline; a total that went down was reset (a router restart).
            delta = None if old is None else (value if value < old[0] else value - old[0])
            self.store.set_total(metric, lab, value, (ts, delta) if delta is not None else None)
        for fld, metric, signal, labels in ROUTER_HISTOGRAMS:
            new = getattr(snap, fld)
            if new is None:
                continue
            self.field_seen[signal] = ts
            if prev is None:
                continue
            lab = labels(snap)
            for value, n in increase(new, getattr(prev, fld)):
                for _ in range(round(n)):
                    self.store.observe(ts, metric, lab, value)
        if snap.overhead_seconds and prev is not None:  # the router's time per phase, scrape over scrape
            for phase, new in snap.overhead_seconds.items():
                old = prev.overhead_seconds.get(phase)
                if old is None:  # a phase's first scrape is its baseline
                    continue
                lab = (snap.router, phase)
                for value, n in increase(new, old):
                    for _ in range(round(n)):
                        self.store.observe(ts, _OVERHEAD, lab, value)
        self.pool.observe_router(snap, ts)

    # ---- readings ------------------------------------------------------------------------------
    def worker_hit_ratio(self, name: str) -> float | None:
        """The worker's recent hit ratio: engine counters in the window, else its records."""
        get = self.store.own_sum
        q = get(("worker_delta", "prefix_queried_tokens", name))
        h = get(("worker_delta", "prefix_hit_tokens", name))
        if q:
            return (h or 0.0) / q
        p = get(("record_prompt", name))
        c = get(("record_cached", name))
        return (c or 0.0) / p if p else None

    def worker_hit_tokens(self, name: str) -> float | None:
        """The worker's hit tokens in the window, from the same source as :meth:`worker_hit_ratio`
        (engine counters, else its records); None when neither measured it."""
        get = self.store.own_sum
        if get(("worker_delta", "prefix_queried_tokens", name)):
            return get(("worker_delta", "prefix_hit_tokens", name)) or 0.0
        if get(("record_prompt", name)):
            return get(("record_cached", name)) or 0.0
        return None

    def worker_tier_hit_tokens(self, name: str) -> dict[str, float] | None:
        """The worker's cached tokens in the window by the tier that served them (None: the engine
        does not report tiers)."""
        out: dict[str, float] = {}
        for key, v in self.store.win.sums.items():
            if key[0] == TIER_HITS and len(key) == 2 and key[1] and key[1][0] == name:
                tier = key[1][-1]
                out[tier] = out.get(tier, 0.0) + v
        return out or None

    def worker_histogram_quantiles(self, name: str, fld: str, q: float) -> dict[str, float] | None:
        """The worker's engine histograms of one kind (``residency``, ``lmcache_seconds``) read at
        quantile ``q`` over the window, by key; a key without observations in the window is left out,
        None when none has any (the engine does not report them, or nothing happened)."""
        out: dict[str, float] = {}
        for fld_name, metrics, _signal, keyed in WORKER_HISTOGRAMS:
            if fld_name != fld:
                continue
            for key, metric in metrics.items():
                hw = self.store.hwin.get(metric)
                if hw is None:
                    continue
                value = hw.quantile(q, (name, key) if keyed else (name,))
                if value is not None:
                    out[key] = value
        return out or None

    def effective_cache_values(self) -> dict[str, float]:
        """Per worker: resident blocks × block size × hit ratio (tokens its cache is worth).

        Every /metrics scrape reads it for every worker: :meth:`worker_hit_ratio` and
        ``WorkerPool.worker_block_size`` are read here in one pass over the windowed sums (the same
        reads and arithmetic, without three calls per sum)."""
        get = self.store.own.sums.get  # MetricStore.own_sum
        workers = self.pool.workers
        default_block_size = int(getattr(self.pool.topology, "block_size", 0) or DEFAULT_BLOCK_SIZE)
        out: dict[str, float] = {}
        for name, blocks in self.index.resident_by_worker().items():
            q = get(("worker_delta", "prefix_queried_tokens", name))
            if q:
                ratio = (get(("worker_delta", "prefix_hit_tokens", name)) or 0.0) / q
            else:
                p = get(("record_prompt", name))
                if not p:
                    continue
                ratio = (get(("record_cached", name)) or 0.0) / p
            w = workers.get(name)
            out[name] = blocks * (w.block_size if w is not None and w.block_size else default_block_size) * ratio
        return out

    @staticmethod
    def removal_ranks(values: dict[str, float]) -> dict[str, int]:
        """1 = safest to remove (least effective cache value; ties by name)."""
        order = sorted(values.items(), key=itemgetter(1, 0))
        return {w: i for i, (w, _v) in enumerate(order, 1)}
