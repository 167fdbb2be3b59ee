"""Is each worker up, down, or gone from the pool? Read from the exporter's own series (pure).

With the exporter as the console's source, ``/api/v1/workers`` states each worker's liveness
(:func:`liveness_from_api`). Beside Prometheus, the console derives it from the exporter's
``/metrics`` by the rules below.

The exporter's JSON API lists every worker it has *seen* (``/api/v1/hotspots``' ``workers``),
including workers that died or left. Whether each one is alive comes from its ``/metrics``:

* ``prefixscope_up{target, kind="worker"}`` — 1 when the worker's last scrape answered, 0 when
  it failed;
* ``prefixscope_router_worker_healthy{router, worker}`` — 0 when a router marks it unhealthy;
* ``prefixscope_telemetry_blind_targets`` — down targets that still receive traffic (the
  exporter does not count a worker whose traffic stopped when it went down: it left the pool);
* ``prefixscope_kv_event_last_timestamp_seconds{worker}`` — the exporter drops this series
  once the worker has left the pool;
* ``prefixscope_worker_pool_size`` — how many workers are healthy right now.

A worker reported down is "left the pool" when the exporter stopped counting it as blind (no
blind target at all, or its KV freshness series gone while others keep theirs), else "down"
(it fails its scrapes but traffic still reaches it). With no scrape and no router health for a
worker, it is "up" when the pool holds every worker seen. When the pool is smaller and exactly
as many workers served traffic in the window (``served``: workers with an effective cache value
in ``/api/v1/hotspots``) as the pool holds, those are the pool and the others have left it
(a worker ages out of the pool when it stops serving). Otherwise the exporter knows the pool is
smaller but not which worker is missing, and the console says "unknown".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from prefixscope.catalog import NAMESPACE

Liveness = Literal["up", "down", "left the pool", "unknown"]
LEFT: Liveness = "left the pool"
UP = f"{NAMESPACE}_up"
ROUTER_HEALTHY = f"{NAMESPACE}_router_worker_healthy"
BLIND = f"{NAMESPACE}_telemetry_blind_targets"
KV_LAST = f"{NAMESPACE}_kv_event_last_timestamp_seconds"
POOL_SIZE = f"{NAMESPACE}_worker_pool_size"
WANTED = (UP, ROUTER_HEALTHY, BLIND, KV_LAST, POOL_SIZE)


@dataclass(frozen=True)
class PoolView:
    """The exporter's per-worker health series, as plain values."""

    scrape_up: Mapping[str, float] = field(default_factory=dict)  # worker -> prefixscope_up
    router_healthy: Mapping[str, float] = field(default_factory=dict)  # worker -> min over routers
    kv_fresh: frozenset[str] = frozenset()  # workers that still have a KV freshness series
    blind_targets: float | None = None
    pool_size: float | None = None


def pool_view_from_text(text: str) -> PoolView:
    """The :class:`PoolView` in a Prometheus text exposition (only the series it needs are read)."""
    wanted = "\n".join(line for line in text.splitlines()
                       if line.startswith(WANTED) and not line.startswith("#"))
    up: dict[str, float] = {}
    router: dict[str, float] = {}
    fresh: set[str] = set()
    blind = pool = None
    for family in text_string_to_metric_families(wanted + "\n"):
        for s in family.samples:
            if s.name == UP and s.labels.get("kind") == "worker":
                up[s.labels.get("target", "")] = s.value
            elif s.name == ROUTER_HEALTHY:
                w = s.labels.get("worker", "")
                router[w] = min(s.value, router.get(w, s.value))
            elif s.name == KV_LAST:
                fresh.add(s.labels.get("worker", ""))
            elif s.name == BLIND:
                blind = s.value
            elif s.name == POOL_SIZE:
                pool = s.value
    return PoolView(up, router, frozenset(fresh), blind, pool)


def largest_sample(text: str, name: str) -> float | None:
    """The largest value of one family's samples in a text exposition (None: it has none)."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith((name + "{", name + " ")))
    values = [s.value for family in text_string_to_metric_families(wanted + "\n") for s in family.samples]
    return max(values) if values else None


def classify(workers: Iterable[str], view: PoolView, served: Iterable[str] = ()) -> dict[str, Liveness]:
    """Each worker's liveness, by the rules in the module docstring."""
    names = list(workers)
    reported_down = {w for w in names if view.scrape_up.get(w) == 0 or view.router_healthy.get(w) == 0}
    all_in_pool = view.pool_size is not None and view.pool_size >= len(names)
    active = {w for w in served if w in names and w not in reported_down}
    pool_is_active = view.pool_size is not None and len(active) == view.pool_size
    out: dict[str, Liveness] = {}
    for w in names:
        if w in reported_down:
            gone_quiet = bool(view.kv_fresh) and w not in view.kv_fresh
            out[w] = LEFT if view.blind_targets == 0 or gone_quiet else "down"
        elif view.scrape_up.get(w) == 1 or view.router_healthy.get(w) == 1 or all_in_pool:
            out[w] = "up"
        elif pool_is_active:
            out[w] = "up" if w in active else LEFT
        else:
            out[w] = "unknown"
    return out


# /api/v1/workers' liveness values → the console's words (anything else is unknown).
API_LIVENESS: dict[str, Liveness] = {"up": "up", "down": "down", "left": LEFT}


def liveness_from_api(rows: Iterable[Mapping[str, object]]) -> dict[str, Liveness]:
    """Each worker's liveness as ``/api/v1/workers`` states it (the exporter applies the rules
    above with what it knows first-hand: its pool, failing targets and traffic since)."""
    return {str(r.get("worker")): API_LIVENESS.get(str(r.get("liveness")), "unknown") for r in rows}


def in_pool(liveness: Mapping[str, Liveness], worker: str) -> bool:
    """Whether the console may rank the worker or name it as holding cache: not once it has left."""
    return liveness.get(worker) != LEFT
