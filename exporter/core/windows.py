"""Sliding windows keyed by input timestamps, and cumulative series for the collector.

Windows expire against the newest timestamp the caller passes (record ``ts``, batch receive
time, scrape time), never against the wall clock, so live ingestion and accelerated replay run
the same code. Quantiles use Prometheus's ``histogram_quantile`` interpolation on the catalogue's
bucket layouts, so the exporter's own check values match what the recording rules compute.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporter.model import CumulativeHistogram

LabelValues = tuple[str, ...]


def bucket_index(bounds: Sequence[float], value: float) -> int:
    """Index of the first bucket whose upper bound (``le``) is ≥ value; len(bounds) is +Inf."""
    return bisect_left(bounds, value)


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """Prometheus's histogram_quantile on per-bucket (non-cumulative) counts; None without data.

    ``counts`` has len(bounds) + 1 entries, the last one the +Inf bucket. As in Prometheus, the
    first bucket interpolates from 0 and a rank in the +Inf bucket yields the highest finite bound.
    """
    total = float(sum(counts))
    if total <= 0 or math.isnan(q):
        return None
    rank = q * total
    cum = 0.0
    for i, c in enumerate(counts):
        if cum + c >= rank and c > 0:
            if i == len(bounds):
                return float(bounds[-1])
            lower = 0.0 if i == 0 else float(bounds[i - 1])
            if i == 0 and bounds[0] <= 0:
                return float(bounds[0])
            return lower + (float(bounds[i]) - lower) * (rank - cum) / c
        cum += c
    return float(bounds[-1])


# Events whose input times fall within the same RESOLUTION_S step (``floor(ts / RESOLUTION_S)``)
# are held together: a slot holds one sum (or one bucket row) per key instead of one entry per
# event, so what a window holds grows with the keys in use and the window's length, not with the
# event rate — nor with the order events arrive in: an event older than the newest joins its own
# step's slot. A slot leaves the window when its newest event does, so an event can outlive its
# window by up to RESOLUTION_S (Prometheus reads window edges at scrape granularity, coarser
# still). Slots leave in time order whatever order they were opened in, so a slot ahead of the
# clock (a timestamp inside the intakes' tolerance) waits for its own time without holding back
# the slots before it.
RESOLUTION_S = 1.0


def margin(t: float) -> float:
    """A safety margin for a time compared against input times: far above the rounding of the few
    float operations between an input time and an expiry test (a relative 1e-12 against their
    ~1e-16), far below any step a window takes."""
    return 1e-9 + 1e-12 * abs(t)


class Wake:
    """The earliest input time at which one of the windows or baselines sharing it may have
    something to do — a lower bound, so before it expiring them is provably a no-op and may be
    skipped. Their owner recomputes it after each pass; a window or baseline that opens a slot
    lowers it to that slot's own earliest action (an event older than the rest can open one that
    is due before every other)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = -math.inf  # nothing known yet: the first pass computes it

    def set(self, t: float) -> None:
        """The earliest action is at input time ``t`` (exact; inf: none, NaN: unknown)."""
        self.at = math.inf if t == math.inf else t - margin(t) if t == t else -math.inf

    def lower(self, t: float) -> None:
        """Something may act from input time ``t`` on (``t`` exact: the margin is taken here)."""
        t -= margin(t)
        if not t >= self.at:  # (NaN lowers it too: a pass then runs and decides)
            self.at = t


class _Slot:
    __slots__ = ("first", "hi", "last", "lo", "rows")

    def __init__(self, ts: float, lo: float, hi: float) -> None:
        self.first = self.last = ts
        self.lo, self.hi = lo, hi  # the step's bounds: lo <= ts < hi
        self.rows: dict = {}  # key -> the slot's sum, or its bucket row


class _Slots:
    """Slots by time step, each opened by its first event; ``due`` and ``expired`` in time order."""

    def __init__(self, window_s: float, resolution_s: float, wake: Wake | None = None) -> None:
        self.window_s = window_s
        self.resolution_s = resolution_s
        self.wake = wake  # told of every slot opened (its owner's expiry skip)
        self.by_step: dict[int, _Slot] = {}
        self._steps: list[int] = []  # a heap of the steps in by_step
        self.tail: _Slot | None = None  # the slot of the latest event (most events join it)
        self.events = 0  # events held (for reporting)

    def __len__(self) -> int:
        return len(self.by_step)

    @property
    def slots(self) -> list[_Slot]:
        """The slots in time order (a copy, for reading)."""
        return [self.by_step[step] for step in sorted(self.by_step)]

    def slot_for(self, ts: float) -> _Slot:
        tail = self.tail
        if tail is not None and tail.lo <= ts < tail.hi:
            if ts > tail.last:
                tail.last = ts
            return tail
        step = math.floor(ts / self.resolution_s)
        slot = self.by_step.get(step)
        if slot is None:
            slot = self.by_step[step] = _Slot(ts, step * self.resolution_s, (step + 1) * self.resolution_s)
            heapq.heappush(self._steps, step)
            if self.wake is not None:  # due once its newest event leaves: never before its first does
                self.wake.lower(ts + self.window_s)
        elif ts > slot.last:
            slot.last = ts
        self.tail = slot
        return slot

    def due(self, now: float) -> bool:
        """The oldest slot has left the window."""
        return bool(self._steps) and self.by_step[self._steps[0]].last <= now - self.window_s

    def due_at(self) -> float:
        """The input time from which :meth:`due` may be true (exact; inf with no slot). Slots
        only move later (a slot's newest event only gets newer), so it stays a lower bound until
        a slot is opened."""
        return self.by_step[self._steps[0]].last + self.window_s if self._steps else math.inf

    def expired(self, now: float) -> Iterable[_Slot]:
        cutoff = now - self.window_s
        steps, by_step = self._steps, self.by_step
        while steps and by_step[steps[0]].last <= cutoff:
            slot = by_step.pop(heapq.heappop(steps))
            if slot is self.tail:
                self.tail = None
            yield slot


class WindowedSum:
    """Sums per key of the values added in the last ``window_s`` seconds."""

    def __init__(self, window_s: float, resolution_s: float = RESOLUTION_S, wake: Wake | None = None) -> None:
        self.window_s = window_s
        self._slots = _Slots(window_s, resolution_s, wake)
        self.sums: dict[Hashable, float] = {}
        self._n: Counter[Hashable] = Counter()  # slots per key still in the window

    def add(self, ts: float, key: Hashable, value: float = 1.0) -> None:
        slots = self._slots
        tail = slots.tail
        if tail is not None and tail.last <= ts < tail.hi:  # slot_for's common case, inline
            tail.last = ts
        else:
            tail = slots.slot_for(ts)
        rows = tail.rows
        if key in rows:
            rows[key] += value
        else:
            rows[key] = value
            self._n[key] += 1
        sums = self.sums
        sums[key] = sums.get(key, 0.0) + value
        slots.events += 1

    def add_many(self, ts: float, items: Iterable[tuple[Hashable, float]]) -> None:
        """``add`` of each (key, value) in order, at the same ``ts`` (the slot looked up once)."""
        slots = self._slots
        rows = slots.slot_for(ts).rows
        sums, n = self.sums, self._n
        added = 0
        for key, value in items:
            if key in rows:
                rows[key] += value
            else:
                rows[key] = value
                n[key] += 1
            sums[key] = sums.get(key, 0.0) + value
            added += 1
        slots.events += added

    def expire(self, now: float) -> None:
        if not self._slots.due(now):  # nothing to expire (the common case)
            return
        sums, n = self.sums, self._n
        for slot in self._slots.expired(now):
            for key, value in slot.rows.items():
                # A key leaves only with its last slot: a sum of zeros (0 stale tokens) is still data.
                n[key] -= 1
                if n[key] == 0:
                    del sums[key], n[key]
                else:
                    sums[key] -= value

    def get(self, key: Hashable) -> float | None:
        """The windowed sum, or None when nothing with this key is in the window."""
        return self.sums.get(key)

    def total(self, keys: Sequence[Hashable] | None = None) -> float | None:
        vals = [v for k, v in self.sums.items() if keys is None or k in keys]
        return sum(vals) if vals else None

    def sums_since(self, since: float) -> dict[Hashable, float]:
        """Sums per key of the slots whose newest event is after ``since`` (a span at the window's
        end, to within a slot: how a check reads the last minute inside its window)."""
        out: dict[Hashable, float] = {}
        for slot in self._slots.by_step.values():
            if slot.last > since:
                for key, value in slot.rows.items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def __len__(self) -> int:
        """Slots held (each one sum per key seen in it)."""
        return len(self._slots)


class PendingSums:
    """Adds to a :class:`WindowedSum` held back, then written once per key and slot (:meth:`flush`).

    Each add still joins the slot :meth:`WindowedSum.add` would give it (decided as it is made:
    adds at the time of the previous one join its slot without asking), and a key's values are
    kept in the order they came, so the flush folds every sum exactly as the adds one by one
    would have (float sums depend on that order). A key new to ``sums`` gets its place there
    on its first add, so the window's order of keys is the same too. Nothing may read or expire
    the window between the first add and the flush.
    """

    __slots__ = ("cur", "parts", "ts", "win")

    def __init__(self, win: WindowedSum) -> None:
        self.win = win
        self.ts: float | None = None  # time of the previous add
        self.cur: dict[Hashable, list[float]] = {}  # key -> values held for the current slot
        self.parts: list[tuple[_Slot, dict[Hashable, list[float]]]] = []

    def at(self, ts: float) -> None:
        """The slot of an add at ``ts`` (made current)."""
        slots = self.win._slots
        tail = slots.tail
        if tail is not None and tail.last <= ts < tail.hi:
            tail.last = ts
        else:
            tail = slots.slot_for(ts)
        self.ts = ts
        if not self.parts or self.parts[-1][0] is not tail:
            self.cur = {}
            self.parts.append((tail, self.cur))

    def add(self, ts: float, key: Hashable, value: float = 1.0) -> bool:
        """Hold one add back; True when it is the key's first in the current slot."""
        if ts != self.ts:
            self.at(ts)
        vals = self.cur.get(key)
        if vals is not None:
            vals.append(value)
            return False
        self.cur[key] = [value]
        sums = self.win.sums
        if key not in sums:
            sums[key] = 0.0
        return True

    def flush(self) -> None:
        win = self.win
        sums, n = win.sums, win._n
        events = 0
        for slot, part in self.parts:
            rows = slot.rows
            for key, vals in part.items():
                total = sums[key]
                row = rows.get(key)
                for v in vals:
                    if row is None:
                        row = v
                        n[key] += 1
                    else:
                        row += v
                    total += v
                rows[key] = row
                sums[key] = total
                events += len(vals)
        win._slots.events += events
        self.ts, self.cur, self.parts = None, {}, []


class WindowedBuckets:
    """Per-key bucket counts of observations made in the last ``window_s`` seconds."""

    def __init__(self, window_s: float, bounds: Sequence[float], resolution_s: float = RESOLUTION_S,
                 wake: Wake | None = None) -> None:
        self.window_s = window_s
        self.bounds = tuple(bounds)
        self._slots = _Slots(window_s, resolution_s, wake)
        self.counts: dict[Hashable, list[int]] = {}

    def observe(self, ts: float, key: Hashable, value: float) -> None:
        self.observe_in(ts, key, bucket_index(self.bounds, value))

    def observe_in(self, ts: float, key: Hashable, i: int, n: int = 1) -> None:
        """``n`` observations in bucket ``i`` (the caller found it)."""
        rows = self._slots.slot_for(ts).rows
        slot_row = rows.get(key)
        if slot_row is None:
            slot_row = rows[key] = [0] * (len(self.bounds) + 1)
        slot_row[i] += n
        row = self.counts.get(key)
        if row is None:
            row = self.counts[key] = [0] * (len(self.bounds) + 1)
        row[i] += n

    def observe_many(self, ts: float, key: Hashable, values: Sequence[float]) -> None:
        """``observe`` of each value at the same ``ts`` (the slot and rows looked up once)."""
        if not values:
            return
        bounds, width = self.bounds, len(self.bounds) + 1
        rows = self._slots.slot_for(ts).rows
        slot_row = rows.get(key)
        if slot_row is None:
            slot_row = rows[key] = [0] * width
        row = self.counts.get(key)
        if row is None:
            row = self.counts[key] = [0] * width
        for value in values:
            i = bisect_left(bounds, value)
            slot_row[i] += 1
            row[i] += 1

    def expire(self, now: float) -> None:
        if not self._slots.due(now):  # nothing to expire (the common case)
            return
        for slot in self._slots.expired(now):
            for key, slot_row in slot.rows.items():
                row = self.counts[key]
                for i, c in enumerate(slot_row):
                    if c:
                        row[i] -= c
                if not any(row):
                    del self.counts[key]

    def counts_since(self, since: float) -> dict[Hashable, list[int]]:
        """Bucket counts per key of the slots whose newest event is after ``since`` (see
        :meth:`WindowedSum.sums_since`)."""
        out: dict[Hashable, list[int]] = {}
        for slot in self._slots.by_step.values():
            if slot.last > since:
                for key, slot_row in slot.rows.items():
                    row = out.get(key)
                    if row is None:
                        row = out[key] = [0] * (len(self.bounds) + 1)
                    for i, c in enumerate(slot_row):
                        row[i] += c
        return out

    def merged(self, key: Hashable | None = None) -> list[int]:
        """Bucket counts of one key, or summed over all keys (``sum by (le)``)."""
        out = [0] * (len(self.bounds) + 1)
        rows = [self.counts.get(key, out)] if key is not None else self.counts.values()
        for row in rows:
            for i, c in enumerate(row):
                out[i] += c
        return out

    def quantile(self, q: float, key: Hashable | None = None) -> float | None:
        return histogram_quantile(q, self.bounds, self.merged(key))

    def count(self, key: Hashable | None = None) -> int:
        return sum(self.merged(key))


class Cumulative:
    """Monotonic counters and cumulative histograms per (metric, label values), for exposition."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[LabelValues, float]] = {}
        # metric -> labels -> [per-bucket counts..., +Inf count, sum]
        self.histograms: dict[str, dict[LabelValues, list[float]]] = {}

    def inc(self, metric: str, labels: LabelValues, value: float = 1.0) -> None:
        series = self.counters.get(metric)
        if series is None:  # (not setdefault: that builds an empty dict on every call)
            series = self.counters[metric] = {}
        series[labels] = series.get(labels, 0.0) + value

    def observe(self, metric: str, labels: LabelValues, bounds: Sequence[float], value: float) -> None:
        series = self.histograms.get(metric)
        if series is None:
            series = self.histograms[metric] = {}
        row = series.get(labels)
        if row is None:
            row = series[labels] = [0.0] * (len(bounds) + 2)
        row[bucket_index(bounds, value)] += 1
        row[-1] += value

    def observe_many(self, metric: str, labels: LabelValues, bounds: Sequence[float],
                     values: Sequence[float]) -> None:
        """``observe`` of each value in order (the same counts and the same running sum)."""
        series = self.histograms.get(metric)
        if series is None:
            series = self.histograms[metric] = {}
        row = series.get(labels)
        if row is None:
            row = series[labels] = [0.0] * (len(bounds) + 2)
        total = row[-1]
        for value in values:
            row[bisect_left(bounds, value)] += 1
            total += value
        row[-1] = total

    def counter(self, metric: str, labels: LabelValues) -> float:
        return self.counters.get(metric, {}).get(labels, 0.0)


def bucket_counts(bounds: Sequence[float], values: Iterable[float] | Counter) -> tuple[list[int], float]:
    """Per-bucket counts (last = +Inf) and sum of observations given as values or a value→count map."""
    tally = values if isinstance(values, Counter) else Counter(values)  # C-level counting first
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for v, n in tally.items():
        counts[bucket_index(bounds, v)] += n
        total += v * n
    return counts, total


def increase(new: CumulativeHistogram, old: CumulativeHistogram | None) -> list[tuple[float, float]]:
    """(value, observations) since ``old``, for re-bucketing a router's histogram into a
    catalogue's: each bucket's new observations placed inside the router's bucket, not at its edge.

    Where inside: the increase's sum says it. Every bucket's observations sit at the same fraction
    of their bucket, the one that makes the placed values add up to the sum's increase (so one
    bucket's observations sit at their exact mean, and all-equal values at that value); without a
    usable sum, mid-bucket, as ``histogram_quantile`` assumes observations spread evenly. A value
    never leaves its router bucket, so "≤ bound" counts stay exact wherever the router's bounds are
    also the catalogue's; the +Inf bucket's are placed at the largest finite bound, as
    ``histogram_quantile`` reads them. A reset (counts went down, or other bounds) starts again from
    ``new``. (Placing a bucket's observations at its upper bound turned Dynamo's exponential
    buckets, 0.1 µs × 2ⁿ, into quantiles up to twice the truth.)
    """
    if old is None or old.bounds != new.bounds or any(n < o for n, o in zip(new.counts, old.counts, strict=True)):
        old = None
    finite = [b for b in new.bounds if math.isfinite(b)]
    top = finite[-1] if finite else 0.0
    buckets: list[tuple[float, float, float]] = []  # (lower, upper, observations) of buckets that grew
    prev_new = prev_old = 0.0
    lower = 0.0
    for i, bound in enumerate(new.bounds):
        in_bucket = new.counts[i] - prev_new - ((old.counts[i] - prev_old) if old is not None else 0.0)
        prev_new = new.counts[i]
        prev_old = old.counts[i] if old is not None else 0.0
        if in_bucket > 0:
            if math.isfinite(bound):
                buckets.append((min(lower, bound), bound, in_bucket))
            else:
                buckets.append((top, top, in_bucket))
        if math.isfinite(bound):
            lower = bound
    fraction = _fraction(buckets, new.sum - (old.sum if old is not None else 0.0))
    out: list[tuple[float, float]] = []
    for lo, hi, n in buckets:
        value = lo + fraction * (hi - lo)
        if hi > lo and value <= lo:  # stay above the lower edge: that value belongs to the bucket below
            value = math.nextafter(lo, math.inf)
        out.append((value, n))
    return out


def _fraction(buckets: Sequence[tuple[float, float, float]], total: float) -> float:
    """The one fraction of every bucket's width that makes the placed values add up to ``total``
    (clamped to the buckets), or one half when the sum cannot say."""
    width = sum(n * (hi - lo) for lo, hi, n in buckets)
    if width <= 0 or not math.isfinite(total):
        return 0.5
    base = sum(n * lo for lo, _hi, n in buckets)
    return min(1.0, max(0.0, (total - base) / width))
