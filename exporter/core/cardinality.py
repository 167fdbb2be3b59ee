"""Bounded label values: what a client may add to /metrics is limited by config, not by its input.

Request records name models, segments and workers freely; each distinct value would become
series of its own, forever. A :class:`LabelBudget` admits at most ``limit`` values of one label:
the values active most recently keep their own series, a new value beyond the limit is counted
under ``other`` (so totals stay whole), and a value unseen for ``idle_s`` of input time frees its
slot — the caller drops its series, so a value that disappeared stops costing anything. Pinned
values (the configured workers) always keep their own series and take no slot.

Every operation is O(1) or O(values evicted): values are kept in last-seen order, so expiry
pops from the front and never walks the rest. Not thread-safe: ``ClusterState`` holds its lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace

from exporter.model import Limits
from prefixscope.records import RequestRecord

OTHER = "other"


class LabelBudget:
    """At most ``limit`` distinct values of one label; the rest fold into :data:`OTHER`."""

    def __init__(self, label: str, limit: int, idle_s: float, pinned: Iterable[str] = ()) -> None:
        self.label = label
        self.limit = limit
        self.idle_s = idle_s
        self.pinned = frozenset(pinned)
        self._last: OrderedDict[str, float] = OrderedDict()  # admitted value -> newest input time, oldest first
        self.folded = 0  # uses folded into OTHER so far
        # No value can expire before this input time: the first value's time plus ``idle_s``
        # (:meth:`expire` walks from the first value). The first value changes when it is popped,
        # seen again (moved to the end) or is the first one in; each of those updates it.
        self.due = math.inf
        self._first: str | None = None

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, value: str) -> bool:
        return value in self._last or value in self.pinned

    def admit(self, value: str, ts: float) -> str:
        """The label value to use for ``value`` seen at input time ``ts``: itself or :data:`OTHER`."""
        if value in self.pinned:
            return value
        last = self._last
        seen = last.get(value)
        if seen is not None:
            if ts >= seen:
                last[value] = ts
                last.move_to_end(value)
                if value == self._first:  # the next value is first now
                    first = self._first = next(iter(last))
                    self.due = last[first] + self.idle_s
            return value
        if len(last) >= self.limit:
            self.folded += 1
            return OTHER
        if not last:
            self.due, self._first = ts + self.idle_s, value
        last[value] = ts
        return value

    def expire(self, now: float) -> list[str]:
        """Forget values unseen for ``idle_s``; returns them (the caller drops their series)."""
        if now < self.due:
            return []
        gone: list[str] = []
        last, cutoff = self._last, now - self.idle_s
        while last:
            value, seen = next(iter(last.items()))
            if seen > cutoff:
                self.due, self._first = seen + self.idle_s, value
                break
            del last[value]
            gone.append(value)
        else:
            self.due, self._first = math.inf, None
        return gone


class RecordLabels:
    """The budgets of the label values request records bring: model, segment and worker.

    :meth:`bound` returns the record with each over-limit value replaced by :data:`OTHER` (the
    record itself when nothing changed, which is the common case), so every step of the
    accounting sees bounded values without knowing about budgets.
    """

    def __init__(self, limits: Limits, window_s: float, pinned_workers: Iterable[str] = ()) -> None:
        idle = max(float(limits.label_idle), float(window_s))  # a value in the window keeps its series
        self.model = LabelBudget("model", limits.models, idle)
        self.segment = LabelBudget("segment", limits.segments, idle)
        self.worker = LabelBudget("worker", limits.workers, idle, pinned_workers)
        self.budgets = (self.model, self.segment, self.worker)

    def pin_workers(self, names: Iterable[str]) -> None:
        """Workers the config names keep their own series whatever the records bring."""
        self.worker.pinned = self.worker.pinned | frozenset(names)

    def bound(self, rec: RequestRecord) -> RequestRecord:
        ts = rec.ts
        worker = self.worker.admit(rec.worker, ts)
        model = rec.model if rec.model is None else self.model.admit(rec.model, ts)
        segment = rec.segment if rec.segment is None else self.segment.admit(rec.segment, ts)
        if worker is rec.worker and model is rec.model and segment is rec.segment:
            return rec
        return replace(rec, worker=worker, model=model, segment=segment)

    def folded(self) -> int:
        return sum(b.folded for b in self.budgets)

    def expire(self, now: float) -> list[tuple[str, str]]:
        """(label, value) of every value that has been gone long enough to drop its series."""
        if now < self.model.due and now < self.segment.due and now < self.worker.due:
            return []  # the common case, checked without a call per budget
        return [(b.label, v) for b in self.budgets for v in b.expire(now)]
