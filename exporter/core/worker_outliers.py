"""Each worker's prefix-cache hit ratio against the median worker's of the cluster.

The exporter's reading of ``worker:prefixscope_prefix_cache_hit_ratio_per_peer_median:ratio`` (the
catalogue's PromQL, parsed once here): per worker, Σ hit tokens / Σ looked-up tokens over the window,
divided by the median of those ratios (Prometheus's ``quantile(0.5, …)``, interpolating between the
two middle workers), for the workers whose looked-up tokens are at least ``worker_peer_traffic`` of
the median worker's. A worker that looked nothing up has no ratio (0/0) and joins no median.
``checks`` evaluates the check with it and ``culprits`` names the workers with it.
"""

from __future__ import annotations

import re

from exporter.core.metric_store import MetricStore
from prefixscope import catalog
from prefixscope.thresholds import Thresholds

RULE = "worker:prefixscope_prefix_cache_hit_ratio_per_peer_median:ratio"
PEER_MEDIAN = re.compile(r"^\(([\w:]+) / on \(\) group_left \(\) quantile\(0\.5, \1\)\) and on \(worker\) "
                         r"\(([\w:]+) >= on \(\) group_left \(\) \(threshold\((\w+)\) \* quantile\(0\.5, \2\)\)\)$")
_RATE_RATIO = re.compile(r"^sum by \(worker\) \(rate\((\w+)\[\w+\]\)\) / sum by \(worker\) \(rate\((\w+)\[\w+\]\)\)$")
_RATE = re.compile(r"^sum by \(worker\) \(rate\((\w+)\[\w+\]\)\)$")


def _parse() -> tuple[str, str, str, str]:
    """(hit counter, looked-up counter, traffic counter, traffic threshold key), without ``_total``."""
    m = PEER_MEDIAN.match(catalog.RULES_BY_NAME[RULE].expr)
    ratio = _RATE_RATIO.match(catalog.RULES_BY_NAME[m[1]].expr) if m else None
    traffic = _RATE.match(catalog.RULES_BY_NAME[m[2]].expr) if m else None
    if m is None or ratio is None or traffic is None:
        raise ImportError(f"exporter/core/worker_outliers.py cannot read {RULE}: extend it with the catalogue")
    return (ratio[1].removesuffix("_total"), ratio[2].removesuffix("_total"), traffic[1].removesuffix("_total"), m[3])


HITS, QUERIED, TRAFFIC, TRAFFIC_KEY = _parse()


def median(values: list[float]) -> float:
    """PromQL's ``quantile(0.5, …)``: the middle value, or between the two middle ones."""
    v = sorted(values)
    rank = 0.5 * (len(v) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def peer_ratios(store: MetricStore, thresholds: Thresholds) -> dict[str, float]:
    """Worker -> its hit ratio over the median worker's, for workers with comparable traffic."""
    hits, queried = store.window_by_worker(HITS), store.window_by_worker(QUERIED)
    traffic = queried if TRAFFIC == QUERIED else store.window_by_worker(TRAFFIC)
    ratios = {w: hits.get(w, 0.0) / d for w, d in queried.items() if d}
    if not ratios or not traffic:
        return {}
    mid, busy = median(list(ratios.values())), median(list(traffic.values()))
    if mid <= 0:
        return {}  # x / 0: no worker stands out against a cluster that hits nothing
    share = thresholds.checks[TRAFFIC_KEY].value
    return {w: r / mid for w, r in ratios.items() if traffic.get(w, 0.0) >= share * busy}
