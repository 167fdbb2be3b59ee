"""The Prometheus collector: every catalogue metric, built fresh on each scrape from the state.

Names, help, label names and buckets come from ``prefixscope.catalog``; values from
``ClusterState.series()`` (which includes the exporter's own ``Health``). A metric whose
source signal is absent is not emitted at all, and ``prefixscope_signal_available{signal}``
says 0 — a missing signal is never rendered as zero. Sample output::

    # HELP prefixscope_worker_resident_blocks Blocks resident on the worker, from its KV events.
    # TYPE prefixscope_worker_resident_blocks gauge
    prefixscope_worker_resident_blocks{worker="w0"} 9000.0
    # TYPE prefixscope_prefix_tree_leaf_depth gaugehistogram
    prefixscope_prefix_tree_leaf_depth_bucket{le="1.0"} 3.0
    ...
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from exporter.core.health import Health
from exporter.core.state import ClusterState, Series
from exporter.core.windows import bucket_counts
from prefixscope import catalog

# A metric is emitted only when the signal named by its catalogue ``source`` is available.
ALWAYS = {"exporter"}


def _le(bound: float) -> str:
    return str(float(bound))


def _buckets(bounds: tuple[float, ...], counts: list[float] | list[int]) -> list[tuple[str, float]]:
    out, cum = [], 0.0
    for b, c in zip((*bounds, float("inf")), counts, strict=False):
        cum += c
        out.append(("+Inf" if b == float("inf") else _le(b), cum))
    return out


def families(series: Series) -> Iterator[Metric]:
    """Metric families for every catalogue metric whose source is available."""
    signals = series.signals
    for m in catalog.METRICS:
        if m.source not in ALWAYS and not signals.get(m.source, False):
            continue
        labels = list(m.labels)
        if m.type == "counter":
            fam = CounterMetricFamily(m.name, m.help, labels=labels, unit="")
            for lv, v in sorted(series.counters.get(m.name, {}).items()):
                fam.add_metric(list(lv), v)
        elif m.type in ("gauge", "info"):
            fam = GaugeMetricFamily(m.name, m.help, labels=labels)
            for lv, v in sorted(series.gauges.get(m.name, {}).items()):
                fam.add_metric(list(lv), v)
        elif m.type == "histogram":
            assert m.buckets is not None
            fam = HistogramMetricFamily(m.name, m.help, labels=labels)
            for lv, row in sorted(series.histograms.get(m.name, {}).items()):
                fam.add_metric(list(lv), _buckets(m.buckets, row[:-1]), row[-1])
        else:  # gaugehistogram: distributions over sessions or tree nodes, never a per-item label
            assert m.buckets is not None
            fam = GaugeHistogramMetricFamily(m.name, m.help, labels=labels)
            obs = series.gaugehistograms.get(m.name)
            if obs is not None:
                counts, total = bucket_counts(m.buckets, obs)
                fam.add_metric([], _buckets(m.buckets, counts), total)
        yield fam


class PrefixscopeCollector(Collector):
    """prometheus_client custom collector over a ``ClusterState`` (register it on a private registry).

    ``health`` defaults to the state's own; it is accepted so callers can name what they wire.
    """

    def __init__(self, state: ClusterState, health: Health | None = None) -> None:
        self.state = state
        if health is not None and health is not state.health:
            raise ValueError("the collector renders the state's Health; pass the same instance")

    def collect(self) -> Iterator[Metric]:
        series = self.state.snapshot_for(lambda st: st.series())
        yield from families(series)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the state; no describe-time registration checks
