"""The exporter's own catalogue counters and histograms, each kept twice.

Cumulative (``cum``) for /metrics, and in sliding windows keyed by input timestamps for the
exporter's own check evaluation: counters in one ``WindowedSum`` keyed ``(metric, labels)``,
histograms in one ``WindowedBuckets`` per metric (plus, for every histogram a recording rule reads
as a baseline — ``[1d] offset 5m`` in the catalogue — a ``LaggedBuckets`` over the configured
baseline window ending one window ago; for the cold-prefill histogram a ``HealthyBaseline``, which
also keeps the healthy windows apart). A separate window (``own``) holds the sums the state keeps
for itself under keys that are not catalogue series (e.g. ``("record_prompt", worker)``), so a
catalogue read never sees them.

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager

from exporter.core.baseline_window import HealthyBaseline, LaggedBuckets, breach_judge
from exporter.core.windows import Cumulative, LabelValues, PendingSums, Wake, WindowedBuckets, WindowedSum
from prefixscope import catalog
from prefixscope.thresholds import Thresholds

DEFAULT_BASELINE_S = 86400.0
BASELINE_RANGE = f"[{catalog.DEFAULT_BASELINE_WINDOW}] offset {catalog.DEFAULT_WINDOW}"
LabelFilter = Callable[[LabelValues], bool]


# The histogram whose healthy windows the baselines average (the rule catalog.COLD_HEALTHY_RATE),
# judged by the two cold-prefill checks that rule leaves out; its classes are catalog.CLASS_BY.
_HEALTHY_RULE = catalog.RULES_BY_NAME[catalog.COLD_HEALTHY_RATE]
HEALTHY_HISTOGRAM = next(m.name for m in catalog.METRICS if m.buckets and f"{m.name}_bucket" in _HEALTHY_RULE.expr)
CLASS_LABELS = tuple(x.strip() for x in catalog.CLASS_BY.split(","))
_RELATIVE_CHECK, _BUDGET_CHECK = "cold_prefill_time_p99", "cold_prefill_budget"


def _healthy_baseline(metric: catalog.Metric, span_s: float, lag_s: float, thresholds: Thresholds,
                      wake: Wake | None = None) -> HealthyBaseline:
    assert metric.buckets is not None
    at = [metric.labels.index(x) for x in CLASS_LABELS]
    relative, budget = catalog.CHECKS_BY_KEY[_RELATIVE_CHECK], catalog.CHECKS_BY_KEY[_BUDGET_CHECK]
    budget_entry = thresholds.checks[budget.threshold]
    judge = breach_judge(0.99, metric.buckets, thresholds.value(relative), budget_entry.budgets or {},
                         budget_entry.value, CLASS_LABELS.index("prompt_class"))
    return HealthyBaseline(span_s, lag_s, metric.buckets, lambda labels: tuple(labels[i] for i in at), judge,
                           wake=wake)


def baseline_histograms() -> list[catalog.Metric]:
    """Histograms some recording rule reads as a baseline (the checks read them the same way)."""
    out: list[catalog.Metric] = []
    for rule in catalog.RECORDING_RULES:
        if BASELINE_RANGE in rule.expr:
            out += [m for m in catalog.METRICS if m.buckets and f"{m.name}_bucket" in rule.expr and m not in out]
    return out


class MetricStore:
    """Cumulative and windowed catalogue counters and histograms."""

    def __init__(self, window_s: float, baseline_s: float = DEFAULT_BASELINE_S,
                 thresholds: Thresholds | None = None) -> None:
        self.window_s = float(window_s)
        self.baseline_s = float(baseline_s)
        self.cum = Cumulative()
        # The earliest input time at which a window or baseline may expire or move something: before
        # it :meth:`expire` and :meth:`advance_baselines` are no-ops (the per-input case), so they
        # skip their windows. Each window and baseline lowers it when it opens a slot.
        self.wake = Wake()
        self.win = WindowedSum(self.window_s, wake=self.wake)  # key (metric, labels)
        self.own = WindowedSum(self.window_s, wake=self.wake)  # the state's own sums, keyed as it likes
        self.hwin: dict[str, WindowedBuckets] = {}
        # With the thresholds, the cold-prefill baseline keeps its healthy windows apart (the checks
        # that judge them need the thresholds); without, every window counts.
        self.baselines: dict[str, LaggedBuckets] = {
            m.name: _healthy_baseline(m, self.baseline_s, self.window_s, thresholds, self.wake)
            if thresholds is not None and m.name == HEALTHY_HISTOGRAM
            else LaggedBuckets(self.baseline_s, self.window_s, m.buckets, wake=self.wake)
            for m in baseline_histograms() if m.buckets}
        # Inside :meth:`batch`: counter adds held back, written at its end (one write per key)
        self._pending: PendingSums | None = None
        self._pending_own: PendingSums | None = None

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold back counter and own-sum adds and write them at the end, once per key and window
        slot, with the same result as writing each at once (see :class:`PendingSums`).

        For a run of writes nothing reads in between (a slice of records under the state lock).
        Dropping a label value or expiring writes what is held first."""
        if self._pending is not None:  # already batching: the outer batch writes
            yield
            return
        self._pending, self._pending_own = PendingSums(self.win), PendingSums(self.own)
        try:
            yield
        finally:
            self.flush()
            self._pending = self._pending_own = None

    def flush(self) -> None:
        """Write the adds held back so far (a no-op outside :meth:`batch`)."""
        pending = self._pending
        if pending is None:
            return
        counters = self.cum.counters
        for _slot, part in pending.parts:
            for (metric, labels), vals in part.items():  # type: ignore[misc]
                series = counters[metric]
                total = series[labels]
                for v in vals:
                    total += v
                series[labels] = total
        pending.flush()
        assert self._pending_own is not None
        self._pending_own.flush()

    # ---- writes --------------------------------------------------------------------------------
    def inc(self, ts: float, metric: str, labels: LabelValues, value: float = 1.0) -> None:
        """Add to a counter, cumulatively and in the window at input time ``ts``."""
        pending = self._pending
        if pending is not None:  # held back (see :meth:`batch`); the key takes its place now
            if not pending.add(ts, (metric, labels), value):
                return
            counters = self.cum.counters
            series = counters.get(metric)
            if series is None:
                series = counters[metric] = {}
            if labels not in series:
                series[labels] = 0.0
            return
        counters = self.cum.counters  # Cumulative.inc, inline: this is the records' hottest write
        series = counters.get(metric)
        if series is None:
            series = counters[metric] = {}
        series[labels] = series.get(labels, 0.0) + value
        self.win.add(ts, (metric, labels), value)

    def inc_many(self, ts: float, items: Sequence[tuple[str, LabelValues, float]]) -> None:
        """:meth:`inc` of each (metric, labels, value) in order, at the same input time."""
        if self._pending is not None:  # inside a batch: held back like every other write
            for metric, labels, value in items:
                self.inc(ts, metric, labels, value)
            return
        counters = self.cum.counters  # Cumulative.inc of each, inline (once per KV batch)
        for metric, labels, value in items:
            series = counters.get(metric)
            if series is None:
                series = counters[metric] = {}
            series[labels] = series.get(labels, 0.0) + value
        self.win.add_many(ts, [((metric, labels), value) for metric, labels, value in items])

    def inc_keyed(self, ts: float, items: Sequence[tuple[tuple[str, LabelValues], float]]) -> None:
        """:meth:`inc_many` of ``((metric, labels), value)`` items whose keys the caller built once
        and reuses (one KV batch's counters per worker): the window takes them as they are, and the
        dicts find a reused key by identity."""
        if self._pending is not None:  # inside a batch: held back like every other write
            for (metric, labels), value in items:
                self.inc(ts, metric, labels, value)
            return
        counters = self.cum.counters
        for key, value in items:
            series = counters.get(key[0])
            if series is None:
                series = counters[key[0]] = {}
            labels = key[1]
            series[labels] = series.get(labels, 0.0) + value
        self.win.add_many(ts, items)

    def zero(self, metric: str, labels: LabelValues) -> None:
        """Create a counter series at 0: a ratio's numerator exists whenever its denominator does."""
        counters = self.cum.counters
        series = counters.get(metric)
        if series is None:
            series = counters[metric] = {}
        if labels not in series:  # an existing series stays as it is (adding 0 would not change it)
            series[labels] = 0.0

    def observe(self, ts: float, metric: str, labels: LabelValues, value: float) -> None:
        """One histogram observation: cumulative, in the window, and in the baseline if kept.
        (``_histogram_write.pxi`` writes the same for the compiled cores, as it does
        :meth:`observe_many`: a change here is a change there.)"""
        hw = self.hwin.get(metric)
        if hw is None:
            m = catalog.METRICS_BY_NAME[metric]
            assert m.buckets is not None
            hw = self.hwin[metric] = WindowedBuckets(self.window_s, m.buckets, wake=self.wake)
        i = bisect_left(hw.bounds, value)  # the bucket, found once for the three places
        # Cumulative.observe, inline
        series = self.cum.histograms.get(metric)
        if series is None:
            series = self.cum.histograms[metric] = {}
        row = series.get(labels)
        if row is None:
            row = series[labels] = [0.0] * (len(hw.bounds) + 2)
        row[i] += 1
        row[-1] += value
        hw.observe_in(ts, labels, i)
        lw = self.baselines.get(metric)
        if lw is not None:
            lw.observe(ts, labels, value)

    def observe_many(self, ts: float, metric: str, labels: LabelValues, values: Sequence[float]) -> None:
        """:meth:`observe` of each value in order, at the same input time (one batch's observations)."""
        if not values:
            return
        hw = self.hwin.get(metric)
        if hw is None:
            m = catalog.METRICS_BY_NAME[metric]
            assert m.buckets is not None
            hw = self.hwin[metric] = WindowedBuckets(self.window_s, m.buckets, wake=self.wake)
        # Cumulative.observe_many and WindowedBuckets.observe_many in one pass: each value's bucket
        # found once for both (the same bounds), the running sum added in order
        bounds = hw.bounds
        histograms = self.cum.histograms
        series = histograms.get(metric)
        if series is None:
            series = histograms[metric] = {}
        row = series.get(labels)
        if row is None:
            row = series[labels] = [0.0] * (len(bounds) + 2)
        rows = hw._slots.slot_for(ts).rows
        slot_row = rows.get(labels)
        if slot_row is None:
            slot_row = rows[labels] = [0] * (len(bounds) + 1)
        counts = hw.counts
        crow = counts.get(labels)
        if crow is None:
            crow = counts[labels] = [0] * (len(bounds) + 1)
        total = row[-1]
        for value in values:
            i = bisect_left(bounds, value)
            row[i] += 1
            slot_row[i] += 1
            crow[i] += 1
            total += value
        row[-1] = total
        lw = self.baselines.get(metric)
        if lw is not None:
            for value in values:
                lw.observe(ts, labels, value)

    def observe_counts(self, ts: float, metric: str, labels: LabelValues,
                       placed: Sequence[tuple[float, float]]) -> None:
        """``n`` observations of ``value`` for each (value, n) — a source's histogram increase placed
        inside its buckets (``windows.increase``) — without one call per observation (an engine's
        page adds thousands between two scrapes). Not for a histogram a baseline reads."""
        if not placed:
            return
        m = catalog.METRICS_BY_NAME[metric]
        assert m.buckets is not None and metric not in self.baselines
        hw = self.hwin.get(metric)
        if hw is None:
            hw = self.hwin[metric] = WindowedBuckets(self.window_s, m.buckets, wake=self.wake)
        rows = self.cum.histograms.setdefault(metric, {})
        row = rows.get(labels)
        if row is None:
            row = rows[labels] = [0.0] * (len(m.buckets) + 2)
        for value, n in placed:
            count = round(n)
            if count <= 0:
                continue
            i = bisect_left(hw.bounds, value)
            row[i] += count
            row[-1] += value * count
            hw.observe_in(ts, labels, i, count)

    def ensure_histogram(self, metric: str, labels: LabelValues) -> None:
        """Create a histogram series with no observation (a source that reports its histogram, still
        empty): exported at zero, as the source says, rather than absent."""
        m = catalog.METRICS_BY_NAME[metric]
        assert m.buckets is not None
        self.cum.histograms.setdefault(metric, {}).setdefault(labels, [0.0] * (len(m.buckets) + 2))

    def set_total(self, metric: str, labels: LabelValues, total: float,
                  increase: tuple[float, float] | None = None) -> None:
        """Mirror a counter a source reports as a running total (engine counters from a scrape);
        ``increase`` = (input time, increase since the previous report) goes into the window."""
        self.cum.counters.setdefault(metric, {})[labels] = total
        if increase is not None:
            self.win.add(increase[0], (metric, labels), increase[1])

    def add_own(self, ts: float, key: Hashable, value: float) -> None:
        """Add to one of the state's own windowed sums (not a catalogue series)."""
        if self._pending_own is not None:
            self._pending_own.add(ts, key, value)
        else:
            self.own.add(ts, key, value)

    def drop_label_value(self, label: str, value: str) -> int:
        """Forget the cumulative series whose ``label`` is ``value`` (a value gone for good: see
        ``exporter.core.cardinality``); returns how many. Windows empty themselves as they expire."""
        self.flush()
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

    def drop_series(self, metric: str, labels: LabelValues) -> bool:
        """Forget one cumulative series (one a source stopped reporting); False if it was not
        held. Its window empties itself as it expires."""
        self.flush()
        for kind in (self.cum.counters, self.cum.histograms):
            series = kind.get(metric)
            if series is not None and series.pop(labels, None) is not None:
                return True
        return False

    def series_count(self) -> int:
        """Cumulative series held (what /metrics renders of the store)."""
        return sum(map(len, self.cum.counters.values())) + sum(map(len, self.cum.histograms.values()))

    def expire(self, now: float) -> None:
        if self._pending is None:
            if now < self.wake.at:  # the per-input case: nothing can have aged out or moved yet
                return
            if not self._expiry_due(now):  # no slot has aged out
                self._advance(now)
                return
        self.flush()
        self.win.expire(now)
        self.own.expire(now)
        for hw in self.hwin.values():
            hw.expire(now)
        self._advance(now)

    def _expiry_due(self, now: float) -> bool:
        """Some window's oldest slot has aged out (each window's own expiry test, read in one
        place: every window here has the store's ``window_s``)."""
        return self.win._slots.due(now) or self.own._slots.due(now) or any(
            hw._slots.due(now) for hw in self.hwin.values())

    def advance_baselines(self, now: float) -> None:
        """Bring the baselines to input time ``now`` (cheap: slots move only at slot edges)."""
        if now >= self.wake.at:  # (before it, no baseline can move a slot)
            self._advance(now)

    def _advance(self, now: float) -> None:
        """Advance the baselines, then find the next input time at which a window or a baseline
        may act (``wake``): lowered from here on by any slot opened, it lets every input before it
        skip the windows."""
        at = math.inf
        for lw in self.baselines.values():
            lw.advance(now)
            nxt = lw.next_action()
            if nxt < at:
                at = nxt
        for slots in (self.win._slots, self.own._slots, *(hw._slots for hw in self.hwin.values())):
            nxt = slots.due_at()
            if nxt < at:
                at = nxt
        self.wake.set(at)

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
        """Per-bucket counts (last = +Inf) of a histogram over the window; None when nothing was
        observed yet. (``window_s`` other than the window is not kept: None.)"""
        if window_s and window_s != self.window_s:
            return None
        hw = self.hwin.get(metric)
        if hw is None:
            return None
        out = [0] * (len(hw.bounds) + 1)
        for labels, row in hw.counts.items():
            if where is None or where(labels):
                for i, c in enumerate(row):
                    out[i] += c
        return hw.bounds, out

    def window_rows(self, metric: str) -> dict[LabelValues, list[int]]:
        """Per label set, a histogram's bucket counts over the window."""
        hw = self.hwin.get(metric)
        return dict(hw.counts) if hw is not None else {}  # type: ignore[arg-type]

    def healthy_baseline_rows(self, metric: str) -> dict[tuple[str, ...], list[int]] | None:
        """Per class (``CLASS_LABELS``), a histogram's counts over the healthy windows of the baseline
        window, or every window's where a class has no healthy one; None when not kept."""
        lw = self.baselines.get(metric)
        return lw.baselines() if isinstance(lw, HealthyBaseline) else None  # type: ignore[return-value]

    def baseline_rows(self, metric: str) -> dict[LabelValues, list[int]]:
        """Per label set, a histogram's bucket counts over the baseline window (ending one window ago)."""
        lw = self.baselines.get(metric)
        return dict(lw.counts) if lw is not None else {}  # type: ignore[arg-type]

    def recent(self, since: float) -> RecentStore:
        """The reads above over the part of the window after input time ``since``."""
        self.flush()
        return RecentStore(self, since)


class RecentStore:
    """:class:`MetricStore`'s window reads over a recent span at the window's end (the last
    minute, say): counters and histograms summed from the slots after ``since``. Baselines and
    cumulative series are the store's own. Built under the state's lock, read at once."""

    def __init__(self, store: MetricStore, since: float) -> None:
        self.cum = store.cum
        self.since = since
        self._sums = store.win.sums_since(since)
        self._rows = {metric: (hw.bounds, hw.counts_since(since)) for metric, hw in store.hwin.items()}
        self._store = store

    def window_counter(self, metric: str, where: LabelFilter | None = None) -> float | None:
        vals = [v for key, v in self._sums.items()
                if key[0] == metric and len(key) == 2 and (where is None or where(key[1]))]
        return sum(vals) if vals else None

    def window_by_worker(self, metric: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, v in self._sums.items():
            if key[0] == metric and len(key) == 2 and key[1]:
                out[key[1][0]] = out.get(key[1][0], 0.0) + v
        return out

    def window_buckets(self, metric: str, window_s: float | None = None,
                       where: LabelFilter | None = None) -> tuple[tuple[float, ...], list[int]] | None:
        got = self._rows.get(metric)
        if got is None or not got[1]:
            return None
        bounds, rows = got
        out = [0] * (len(bounds) + 1)
        for labels, row in rows.items():
            if where is None or where(labels):
                for i, c in enumerate(row):
                    out[i] += c
        return bounds, out

    def window_rows(self, metric: str) -> dict[LabelValues, list[int]]:
        got = self._rows.get(metric)
        return dict(got[1]) if got is not None else {}  # type: ignore[arg-type]

    def baseline_rows(self, metric: str) -> dict[LabelValues, list[int]]:
        return self._store.baseline_rows(metric)

    def healthy_baseline_rows(self, metric: str) -> dict[tuple[str, ...], list[int]] | None:
        return self._store.healthy_baseline_rows(metric)
