"""Histogram counts over a long window that ends one short window ago: the baselines.

A baseline (``rate(x_bucket[1d] offset 5m)``) must cover a day of observations without keeping
each one, so observations are tallied in time slots and each slot joins the running total once it
is older than the lag and leaves it once it is older than lag + span. Memory is one bucket row per
slot and label set that saw an observation; a read is the running total (no pass over the slots).

Times are input timestamps, as everywhere in the exporter (``exporter.core.windows``). Slots make the
window edges ``slot_s`` coarse; Prometheus reads the same edges at scrape granularity anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

from exporter.core.windows import bucket_index

SLOT_S = 15.0  # one scrape interval


class LaggedBuckets:
    """Per-key bucket counts of observations made in ``(now - lag_s - span_s, now - lag_s]``."""

    def __init__(self, span_s: float, lag_s: float, bounds: Sequence[float], slot_s: float = SLOT_S) -> None:
        self.span_s, self.lag_s, self.slot_s = float(span_s), float(lag_s), float(slot_s)
        self.bounds = tuple(bounds)
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
