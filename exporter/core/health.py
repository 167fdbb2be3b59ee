"""The exporter's own health: counters and gauges that source adapters update.

Bad input never crashes a source: it calls :meth:`Health.error`, which counts the error by
source and kind (``prefixscope_ingest_errors_total``) and logs the first occurrence of each
(source, kind) with its context, so a flood of one malformed input does not flood the log.
Other series (KV-event stream health, target up) go through :meth:`inc` and :meth:`set`
under catalogue metric names; the collector renders whatever is here.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable

from prefixscope.catalog import METRICS_BY_NAME

_ABSENT = object()  # a gauge series not set yet

log = logging.getLogger("prefixscope.ingest")

LabelValues = tuple[str, ...]


class Health:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, dict[LabelValues, float]] = defaultdict(dict)
        self.gauges: dict[str, dict[LabelValues, float]] = defaultdict(dict)
        self._logged: set[tuple[str, str]] = set()
        self._checked: set[tuple[str, int]] = set()  # (metric, label count) pairs already validated
        self._totals: dict[str, float] = {}  # counter -> sum over its label sets (read per KV batch)
        self._gauge_writes: dict[str, int] = {}  # gauge -> sets and removes so far (a change marker)
        # gauge -> the change sets of its followers (see :meth:`follow`); most gauges have none
        self._followers: dict[str, list[set[LabelValues]]] = {}

    def check(self, metric: str, labels: LabelValues) -> None:
        """Validate a series against the catalogue now (KeyError if it is none), so writers that
        checked their series up front can skip it per write (``update(checked=True)``)."""
        self._check(metric, labels)

    def _check(self, metric: str, labels: LabelValues) -> None:
        key = (metric, len(labels))
        if key in self._checked:
            return
        m = METRICS_BY_NAME.get(metric)
        if m is None or len(m.labels) != len(labels):
            raise KeyError(f"{metric}{labels} is not a catalogue metric with these labels")
        self._checked.add(key)

    def _inc(self, metric: str, labels: LabelValues, n: float) -> None:  # caller holds the lock
        series = self.counters[metric]
        series[labels] = series.get(labels, 0.0) + n
        self._totals[metric] = self._totals.get(metric, 0.0) + n

    def _set(self, metric: str, labels: LabelValues, value: float) -> None:  # caller holds the lock
        series = self.gauges[metric]
        if series.get(labels, _ABSENT) != value:  # the same value again is no change
            series[labels] = value
            self._changed(metric, labels)

    def _changed(self, metric: str, labels: LabelValues) -> None:  # caller holds the lock
        self._gauge_writes[metric] = self._gauge_writes.get(metric, 0) + 1
        for changes in self._followers.get(metric, ()):
            changes.add(labels)

    def follow(self, metric: str) -> set[LabelValues]:
        """A set that collects the label values of each series of gauge ``metric`` that changes from
        now on (set to a new value, or removed), its present series included: a reader that keeps
        something derived from the gauge applies what changed (:meth:`take`) instead of reading
        every series again. It holds each series once, however often it changed."""
        with self._lock:
            changes = set(self.gauges.get(metric, ()))
            self._followers.setdefault(metric, []).append(changes)
        return changes

    def take(self, changes: set[LabelValues]) -> list[LabelValues]:
        """Empty a set :meth:`follow` returned; what it held (the series to read again)."""
        with self._lock:
            out = list(changes)
            changes.clear()
        return out

    def update(self, incs: Iterable[tuple[str, LabelValues, float]] = (),
               sets: Iterable[tuple[str, LabelValues, float]] = (), checked: bool = False) -> None:
        """Several increments and gauge sets under one lock (per-batch accounting on hot paths).
        ``checked``: the caller validated every series it writes with :meth:`check` beforehand."""
        if type(incs) is not list:  # (a list is read twice as it is: no copy on the per-batch path)
            incs = list(incs)
        if type(sets) is not list:
            sets = list(sets)
        if not checked:
            known = self._checked
            for metric, labels, _v in incs + sets if sets else incs:
                if (metric, len(labels)) not in known:
                    self._check(metric, labels)
        lock = self._lock  # (acquire/release: a little cheaper than ``with`` once per KV batch)
        lock.acquire()
        try:
            counters, totals = self.counters, self._totals
            for metric, labels, n in incs:
                series = counters[metric]
                series[labels] = series.get(labels, 0.0) + n
                totals[metric] = totals.get(metric, 0.0) + n
            if sets:
                gauges, writes = self.gauges, self._gauge_writes
                followers = self._followers
                for metric, labels, value in sets:
                    series = gauges[metric]
                    if series.get(labels, _ABSENT) != value:
                        series[labels] = value
                        writes[metric] = writes.get(metric, 0) + 1
                        if metric in followers:
                            for changes in followers[metric]:
                                changes.add(labels)
        finally:
            lock.release()

    def inc(self, metric: str, labels: LabelValues = (), n: float = 1.0) -> None:
        self._check(metric, labels)
        with self._lock:
            self._inc(metric, labels, n)

    def set(self, metric: str, labels: LabelValues, value: float) -> None:
        self._check(metric, labels)
        with self._lock:
            self._set(metric, labels, value)

    def set_existing(self, metric: str, labels: LabelValues, value: float) -> None:
        """Set a gauge's series only if it exists (a reader that must not create one)."""
        with self._lock:
            if labels in self.gauges.get(metric, {}):
                self._set(metric, labels, value)

    def remove(self, metric: str, labels: LabelValues) -> None:
        with self._lock:
            if self.gauges.get(metric, {}).pop(labels, None) is not None:
                self._changed(metric, labels)

    def drop_worker(self, name: str, counters: bool = True) -> None:
        """Remove every series whose ``worker`` (or, for worker targets, ``target``) is ``name``:
        its gauges at once when it leaves, with ``counters`` too once its series retire."""
        with self._lock:
            kinds = (self.gauges, self.counters) if counters else (self.gauges,)
            for kind in kinds:
                for metric, series in kind.items():
                    m = METRICS_BY_NAME.get(metric)
                    if m is None:
                        continue
                    if "worker" in m.labels:
                        at = m.labels.index("worker")
                        gone = [lv for lv in series if lv[at] == name]
                    elif m.labels[:2] == ("target", "kind"):
                        gone = [lv for lv in series if lv == (name, "worker")]
                    else:
                        continue
                    for lv in gone:
                        value = series.pop(lv)
                        if kind is self.counters:
                            self._totals[metric] = self._totals.get(metric, 0.0) - value
                        else:
                            self._changed(metric, lv)

    def total(self, metric: str) -> float | None:
        """Σ of a counter over its label sets; None while it has no series (nothing on /metrics)."""
        return self._totals.get(metric) if self.counters.get(metric) else None

    def gauge_writes(self, metric: str) -> int:
        """How often a gauge's values changed (a series set to a new value, or removed): the
        same count means the same values, so a reader can skip what depends only on them."""
        return self._gauge_writes.get(metric, 0)

    def error(self, source: str, kind: str, context: str, n: int = 1) -> None:
        """Count ``n`` rejected inputs; log the first of each (source, kind) with context."""
        self.inc("prefixscope_ingest_errors", (source, kind), n)
        key = (source, kind)
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        if first:
            log.warning("rejected %s input (%s): %s — further errors of this kind are only counted", source, kind, context)

    def snapshot(self) -> tuple[dict[str, dict[LabelValues, float]], dict[str, dict[LabelValues, float]]]:
        with self._lock:
            return ({k: dict(v) for k, v in self.counters.items()}, {k: dict(v) for k, v in self.gauges.items()})

    def counter_value(self, metric: str, labels: LabelValues = ()) -> float:
        with self._lock:
            return self.counters.get(metric, {}).get(labels, 0.0)
