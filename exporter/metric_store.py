"""The exporter's own catalogue counters and histograms, each kept twice.

Cumulative (``cum``) for /metrics, and in sliding windows keyed by input timestamps for the
exporter's own check evaluation: counters in one ``WindowedSum`` keyed ``(metric, labels)``,
histograms in one ``WindowedBuckets`` per metric (plus a longer one for every histogram a
recording rule reads over ``[1h]``). A separate window (``own``) holds the sums the state keeps
for itself under keys that are not catalogue series (e.g. ``("record_prompt", worker)``), so a
catalogue read never sees them.

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from exporter.windows import Cumulative, LabelValues, WindowedBuckets, WindowedSum
from prefixscope import catalog

LONG_WINDOW_S = 3600.0
LabelFilter = Callable[[LabelValues], bool]


def long_window_histograms() -> list[catalog.Metric]:
    """Histograms some recording rule reads over one hour (the checks read them the same way)."""
    out: list[catalog.Metric] = []
    for rule in catalog.RECORDING_RULES:
        if "[1h]" in rule.expr:
            out += [m for m in catalog.METRICS if m.buckets and f"{m.name}_bucket" in rule.expr and m not in out]
    return out


class MetricStore:
    """Cumulative and windowed catalogue counters and histograms."""

    def __init__(self, window_s: float) -> None:
        self.window_s = float(window_s)
        self.cum = Cumulative()
        self.win = WindowedSum(self.window_s)  # key (metric, labels)
        self.own = WindowedSum(self.window_s)  # the state's own sums, keyed as it likes
        self.hwin: dict[str, WindowedBuckets] = {}
        self.long_hwin: dict[tuple[str, float], WindowedBuckets] = {
            (m.name, LONG_WINDOW_S): WindowedBuckets(LONG_WINDOW_S, m.buckets)
            for m in long_window_histograms() if m.buckets}

    # ---- writes --------------------------------------------------------------------------------
    def inc(self, ts: float, metric: str, labels: LabelValues, value: float = 1.0) -> None:
        """Add to a counter, cumulatively and in the window at input time ``ts``."""
        self.cum.inc(metric, labels, value)
        self.win.add(ts, (metric, labels), value)

    def zero(self, metric: str, labels: LabelValues) -> None:
        """Create a counter series at 0: a ratio's numerator exists whenever its denominator does."""
        self.cum.inc(metric, labels, 0.0)

    def observe(self, ts: float, metric: str, labels: LabelValues, value: float) -> None:
        """One histogram observation: cumulative, in the window, and in the long window if kept."""
        m = catalog.METRICS_BY_NAME[metric]
        assert m.buckets is not None
        self.cum.observe(metric, labels, m.buckets, value)
        hw = self.hwin.get(metric)
        if hw is None:
            hw = self.hwin[metric] = WindowedBuckets(self.window_s, m.buckets)
        hw.observe(ts, labels, value)
        lw = self.long_hwin.get((metric, LONG_WINDOW_S))
        if lw is not None:
            lw.observe(ts, labels, value)

    def set_total(self, metric: str, labels: LabelValues, total: float,
                  increase: tuple[float, float] | None = None) -> None:
        """Mirror a counter a source reports as a running total (engine counters from a scrape);
        ``increase`` = (input time, increase since the previous report) goes into the window."""
        self.cum.counters.setdefault(metric, {})[labels] = total
        if increase is not None:
            self.win.add(increase[0], (metric, labels), increase[1])

    def add_own(self, ts: float, key: Hashable, value: float) -> None:
        """Add to one of the state's own windowed sums (not a catalogue series)."""
        self.own.add(ts, key, value)

    def drop_label_value(self, label: str, value: str) -> int:
        """Forget the cumulative series whose ``label`` is ``value`` (a value gone for good: see
        ``exporter.cardinality``); returns how many. Windows empty themselves as they expire."""
        dropped = 0
        for kind in (self.cum.counters, self.cum.histograms):
            for metric, series in kind.items():
                m = catalog.METRICS_BY_NAME.get(metric)
                if m is None or label not in m.labels:
                    continue
                at = m.labels.index(label)
                gone = [lv for lv in series if len(lv) > at and lv[at] == value]
                for lv in gone:
                    del series[lv]
                dropped += len(gone)
        return dropped

    def series_count(self) -> int:
        """Cumulative series held (what /metrics renders of the store)."""
        return sum(map(len, self.cum.counters.values())) + sum(map(len, self.cum.histograms.values()))

    def expire(self, now: float) -> None:
        self.win.expire(now)
        self.own.expire(now)
        for hw in self.hwin.values():
            hw.expire(now)
        for lw in self.long_hwin.values():
            lw.expire(now)

    # ---- reads ---------------------------------------------------------------------------------
    def own_sum(self, key: Hashable) -> float | None:
        """One of the state's own windowed sums; None when nothing with this key is in the window."""
        return self.own.get(key)

    def window_counter(self, metric: str, where: LabelFilter | None = None) -> float | None:
        """Σ over the window of a catalogue counter (all label sets, or those ``where`` accepts)."""
        vals = [v for key, v in self.win.sums.items()
                if key[0] == metric and len(key) == 2 and (where is None or where(key[1]))]
        return sum(vals) if vals else None

    def window_by_worker(self, metric: str) -> dict[str, float]:
        """Σ over the window of a counter whose first label is the worker, per worker."""
        out: dict[str, float] = {}
        for key, v in self.win.sums.items():
            if key[0] == metric and len(key) == 2 and key[1]:
                out[key[1][0]] = out.get(key[1][0], 0.0) + v
        return out

    def window_buckets(self, metric: str, window_s: float | None = None,
                       where: LabelFilter | None = None) -> tuple[tuple[float, ...], list[int]] | None:
        """Per-bucket counts (last = +Inf) of a histogram over the window, or over ``window_s`` if a
        longer window is kept for it; None when no such window exists (nothing observed yet)."""
        hw = self.long_hwin.get((metric, window_s)) if window_s and window_s != self.window_s else self.hwin.get(metric)
        if hw is None:
            return None
        out = [0] * (len(hw.bounds) + 1)
        for labels, row in hw.counts.items():
            if where is None or where(labels):
                for i, c in enumerate(row):
                    out[i] += c
        return hw.bounds, out
