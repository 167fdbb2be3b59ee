"""The exporter's own process on /metrics: the standard ``process_*`` and ``python_gc_*`` series
and the duty clock's ``prefixscope_exporter_duty_*``.

``process_*`` are prometheus_client's ``ProcessCollector`` series (same names, help and
semantics, read from Linux /proc once per scrape: ``/proc/self/stat``, ``limits`` and the
``fd`` listing), so the usual process dashboards work. Where /proc cannot be read they are
left out, never written as 0. ``python_gc_*`` are the ``GCCollector`` series (``gc.get_stats``).

These series describe the process, not the cluster, so they are not part of the state's
``Series`` (``exporter.core.series_view``) nor of its renderers: :class:`SelfMetrics` is a collector
of its own. The runtime registers it next to the state's collector (OpenMetrics) and appends
:meth:`SelfMetrics.render_text` to the state's text exposition; its family names differ from
every catalogue family the state renders, so the two parts never repeat a family.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from exporter.loops.duty_clock import DUTIES, DutyClock, DutyTotals
from prefixscope import catalog

DUTY_CPU = catalog.METRICS_BY_NAME[f"{catalog.NAMESPACE}_exporter_duty_cpu_seconds"]
DUTY_WALL = catalog.METRICS_BY_NAME[f"{catalog.NAMESPACE}_exporter_duty_seconds"]


def gc_families() -> Iterator[Metric]:
    """``python_gc_*`` as prometheus_client's GCCollector writes them (per generation)."""
    collected = CounterMetricFamily("python_gc_objects_collected", "Objects collected during gc",
                                    labels=["generation"])
    uncollectable = CounterMetricFamily("python_gc_objects_uncollectable", "Uncollectable objects found during GC",
                                        labels=["generation"])
    collections = CounterMetricFamily("python_gc_collections", "Number of times this generation was collected",
                                      labels=["generation"])
    for gen, stat in enumerate(gc.get_stats()):
        collected.add_metric([str(gen)], stat["collected"])
        uncollectable.add_metric([str(gen)], stat["uncollectable"])
        collections.add_metric([str(gen)], stat["collections"])
    yield from (collected, uncollectable, collections)


def duty_families(totals: DutyTotals, buckets: tuple[float, ...]) -> Iterator[Metric]:
    """The duty clock's counter and histogram, every duty always present (0 until it first runs)."""
    cpu = CounterMetricFamily(DUTY_CPU.name, DUTY_CPU.help, labels=list(DUTY_CPU.labels))
    wall = HistogramMetricFamily(DUTY_WALL.name, DUTY_WALL.help, labels=list(DUTY_WALL.labels))
    for duty in DUTIES:
        cpu.add_metric([duty], totals.cpu[duty])
        row = totals.wall[duty]
        cum, rows = 0.0, []
        for bound, count in zip((*buckets, float("inf")), row[:-1], strict=True):
            cum += count
            rows.append(("+Inf" if bound == float("inf") else str(float(bound)), cum))
        wall.add_metric([duty], rows, row[-1])
    yield from (cpu, wall)


class SelfMetrics(Collector):
    """Process, GC and duty series of this exporter (a prometheus_client collector)."""

    def __init__(self, duties: DutyClock, proc: str = "/proc") -> None:
        self.duties = duties
        self._process = ProcessCollector(proc=proc, registry=None)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def collect(self) -> Iterator[Metric]:
        totals = self.duties.totals()  # before the process's CPU: their sum stays at most the process's
        yield from self._process.collect()  # nothing when /proc is unreadable
        yield from gc_families()
        yield from duty_families(totals, self.duties.buckets)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def render_text(self) -> bytes:
        """These families in the Prometheus text format (0.0.4), to append to the state's exposition."""
        return generate_latest(self._registry)
