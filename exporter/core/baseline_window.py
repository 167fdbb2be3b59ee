"""Histogram counts over a long window that ends one short window ago: the baselines.

A baseline (``rate(x_bucket[1d] offset 5m)``) must cover a day of observations without keeping
each one, so observations are tallied in time slots and each slot joins the running total once it
is older than the lag and leaves it once it is older than lag + span. Memory is one bucket row per
slot and label set that saw an observation; a read is the running total (no pass over the slots).

Times are input timestamps, as everywhere in the exporter (``exporter.core.windows``). Slots make the
window edges ``slot_s`` coarse; Prometheus reads the same edges at scrape granularity anyway.

:class:`HealthyBaseline` adds the baseline that does not absorb incidents (the catalogue's
``avg_over_time(prompt_class:…:rate5m_healthy[1d] offset 5m)``): Prometheus records each
evaluation's window rates while no cold-prefill check breaches and averages them over the day,
so an observation counts once for every healthy evaluation whose window held it. Here every slot
edge is such an evaluation ("tick"): the classes that do not breach add one to the weight of each
slot still in the window, and a slot joins the healthy total with those weights when it leaves
the window (by then every tick that saw it has passed). Memory: one small weight per slot and class.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence

from exporter.core.windows import Wake, bucket_index, histogram_quantile

SLOT_S = 15.0  # one scrape interval


class LaggedBuckets:
    """Per-key bucket counts of observations made in ``(now - lag_s - span_s, now - lag_s]``."""

    def __init__(self, span_s: float, lag_s: float, bounds: Sequence[float], slot_s: float = SLOT_S,
                 wake: Wake | None = None) -> None:
        self.span_s, self.lag_s, self.slot_s = float(span_s), float(lag_s), float(slot_s)
        self.bounds = tuple(bounds)
        self.wake = wake  # told of every slot opened (its owner's skip of :meth:`advance`)
        self._pending: deque[tuple[int, dict[Hashable, list[int]]]] = deque()  # newer than now - lag
        self._active: deque[tuple[int, dict[Hashable, list[int]]]] = deque()  # inside the window
        self.counts: dict[Hashable, list[int]] = {}  # Σ of the active slots
        self.version = 0  # counts changed since this was last read: a reader may keep what it derived

    def _row(self, slot: dict[Hashable, list[int]], key: Hashable) -> list[int]:
        row = slot.get(key)
        if row is None:
            row = slot[key] = [0] * (len(self.bounds) + 1)
        return row

    def observe(self, ts: float, key: Hashable, value: float) -> None:
        """Tally one observation at input time ``ts`` (late ones go into their own, older slot)."""
        n = int(ts // self.slot_s)
        i = bucket_index(self.bounds, value)
        for idx, slot in reversed(self._pending):
            if idx == n:
                self._row(slot, key)[i] += 1
                return
            if idx < n:
                break
        if self.wake is not None:  # a new slot: it joins the total once it is older than the lag
            self.wake.lower((n + 1) * self.slot_s + self.lag_s)
        if not self._pending or self._pending[-1][0] < n:
            slot: dict[Hashable, list[int]] = {}
            self._row(slot, key)[i] += 1
            self._pending.append((n, slot))
            return
        # Older than every pending slot but not yet matured: keep the pending slots in order.
        slot = {}
        self._row(slot, key)[i] += 1
        items = sorted([*self._pending, (n, slot)], key=lambda s: s[0])
        self._pending = deque(items)

    def next_action(self) -> float:
        """The input time from which :meth:`advance` may move a slot (exact; inf when none can):
        the earlier of the oldest pending slot's end plus the lag and the oldest active slot's
        end plus the lag and the span. Only an observation that opens a slot makes it earlier."""
        at = math.inf
        if self._pending:
            at = (self._pending[0][0] + 1) * self.slot_s + self.lag_s
        if self._active:
            at = min(at, (self._active[0][0] + 1) * self.slot_s + self.lag_s + self.span_s)
        return at

    def advance(self, now: float) -> None:
        """Move slots that have aged past the lag into the total and drop those past lag + span."""
        end, start = now - self.lag_s, now - self.lag_s - self.span_s
        while self._pending and (self._pending[0][0] + 1) * self.slot_s <= end:
            idx, slot = self._pending.popleft()
            self._active.append((idx, slot))
            self._add(slot, 1)
        while self._active and (self._active[0][0] + 1) * self.slot_s <= start:
            _idx, slot = self._active.popleft()
            self._add(slot, -1)

    def _add(self, slot: dict[Hashable, list[int]], sign: int) -> None:
        self.version += 1
        for key, row in slot.items():
            total = self._row(self.counts, key)
            for i, c in enumerate(row):
                total[i] += sign * c
            if not any(total):
                del self.counts[key]

    def merged(self, where: Callable[[Hashable], bool] | None = None) -> list[int]:
        """Bucket counts summed over the keys ``where`` accepts (all by default)."""
        out = [0] * (len(self.bounds) + 1)
        for key, row in self.counts.items():
            if where is None or where(key):
                for i, c in enumerate(row):
                    out[i] += c
        return out


ClassKey = Hashable
# (class, the window's bucket counts, the baseline's) -> the class breaches a check at this tick
Judge = Callable[[ClassKey, Sequence[int], Sequence[int] | None], bool]


def _add_row(into: dict[ClassKey, list[int]], key: ClassKey, row: Sequence[int], times: int, width: int) -> None:
    total = into.get(key)
    if total is None:
        total = into[key] = [0] * width
    for i, c in enumerate(row):
        total[i] += times * c
    if not any(total):
        del into[key]


class HealthyBaseline(LaggedBuckets):
    """:class:`LaggedBuckets` that also keeps, per class (``class_of`` of an observation's key),
    the counts of the baseline window's healthy windows: those in which ``judge`` found the class
    not breaching (see the module's docstring)."""

    def __init__(self, span_s: float, lag_s: float, bounds: Sequence[float], class_of: Callable[[Hashable], ClassKey],
                 judge: Judge, slot_s: float = SLOT_S, wake: Wake | None = None) -> None:
        super().__init__(span_s, lag_s, bounds, slot_s, wake)
        self.class_of, self.judge = class_of, judge
        self._width = len(self.bounds) + 1
        self.window: dict[ClassKey, list[int]] = {}  # Σ of the pending slots per class: the current window
        self.plain: dict[ClassKey, list[int]] = {}  # Σ of the active slots per class (``counts`` by class)
        self.healthy: dict[ClassKey, list[int]] = {}  # Σ weight × row of the active slots per class
        self._weights: dict[int, dict[ClassKey, int]] = {}  # id(slot) -> healthy ticks that saw it, per class
        self._tick: int | None = None  # the last slot edge judged

    def observe(self, ts: float, key: Hashable, value: float) -> None:
        super().observe(ts, key, value)
        row = self.window.get(self.class_of(key))
        if row is None:
            row = self.window[self.class_of(key)] = [0] * self._width
        row[bucket_index(self.bounds, value)] += 1

    def advance(self, now: float) -> None:
        tick = int(now // self.slot_s)
        last, self._tick = self._tick, max(tick, self._tick if self._tick is not None else tick)
        if last is not None:
            for k in range(last + 1, tick + 1):
                t = k * self.slot_s
                super().advance(t)
                if not self._pending:
                    break  # nothing in the window: the later ticks weigh nothing
                self._judge_tick(k)
        super().advance(now)

    def next_action(self) -> float:
        """As the plain baseline's, and also the next slot edge: each is a tick, judged (or, with
        nothing pending, passed) as :meth:`advance` reaches it. Before the first advance, now."""
        if self._tick is None:
            return -math.inf
        return min(super().next_action(), (self._tick + 1) * self.slot_s)

    def _judge_tick(self, k: int) -> None:
        """One evaluation at slot edge ``k``: each class that does not breach weighs the slots
        its window holds (those that began before the edge)."""
        healthy = [c for c, row in self.window.items() if any(row) and not self.judge(c, row, self.baseline_of(c))]
        if not healthy:
            return
        for idx, slot in self._pending:
            if idx >= k:
                break
            weights = self._weights.setdefault(id(slot), {})
            for c in healthy:
                weights[c] = weights.get(c, 0) + 1

    def _add(self, slot: dict[Hashable, list[int]], sign: int) -> None:
        super()._add(slot, sign)
        w = self._width
        weights = self._weights.get(id(slot), {}) if sign > 0 else self._weights.pop(id(slot), {})
        for key, row in slot.items():
            c = self.class_of(key)
            if sign > 0:  # leaves the window, joins the baseline
                _add_row(self.window, c, row, -1, w)
            _add_row(self.plain, c, row, sign, w)
            if weights.get(c):
                _add_row(self.healthy, c, row, sign * weights[c], w)

    def baseline_of(self, c: ClassKey) -> list[int] | None:
        """The class's baseline counts: its healthy windows', or where it has none, every window's."""
        return self.healthy.get(c) or self.plain.get(c)

    def baselines(self) -> dict[ClassKey, list[int]]:
        """Every class's baseline counts (:meth:`baseline_of`)."""
        return {c: self.healthy.get(c) or row for c, row in self.plain.items()}


def breach_judge(q: float, bounds: Sequence[float], factor: float, budgets: Mapping[str, float],
                 budget_limit: float, class_label_at: int) -> Judge:
    """The cold-prefill checks at one tick, as the rule that keeps the healthy windows has them:
    the window's ``q`` quantile above ``factor`` × the baseline's, or above ``budget_limit`` × the
    budget of the class (its prompt class at ``class_label_at`` of the class key)."""
    def judge(c: ClassKey, window: Sequence[int], baseline: Sequence[int] | None) -> bool:
        now = histogram_quantile(q, bounds, window)
        if now is None:
            return False
        base = histogram_quantile(q, bounds, baseline) if baseline else None
        if base and now / base > factor:
            return True
        budget = budgets.get(c[class_label_at]) if isinstance(c, tuple) else None  # type: ignore[index]
        return bool(budget) and now / budget > budget_limit  # type: ignore[operator]
    return judge
