"""Windowed increases of the exporter's own health counters (what the checks read as increase/rate).

``Health`` keeps running totals; the checks ask how much a total rose over the window, as
Prometheus's ``increase()`` would. Samples of (input time, total) are kept while they can still
be the window's start; the first sample is 0 at the exporter's first input, so the first error
inside the window shows.

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from exporter.core.health import Health
from exporter.core.input_time import InputTime


class HealthIncreases:
    def __init__(self, health: Health, time: InputTime, window_s: float, names: Iterable[str]) -> None:
        self.health = health
        self.time = time
        self.window_s = window_s
        self.names = tuple(names)
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._quiet_until = float("-inf")  # before this input time no sample is due (see :meth:`sample`)
        self._seen: tuple[float | None, ...] = ()  # the totals the last full pass saw

    def sample(self) -> None:
        """Keep a (time, total) sample of each counter when it moved or the last one is getting old."""
        now = self.time.now
        # Nothing to do (the per-batch case): no total moved since the last pass, and no sample
        # can be due or expired yet (``_quiet_until`` keeps a second of margin against rounding).
        totals = self.health._totals
        if now < self._quiet_until and self._seen == tuple(map(totals.get, self.names)):
            return
        quiet = float("inf")
        for name in self.names:
            total = self.health.total(name) or 0.0
            dq = self._samples.get(name)
            if dq is None:  # counting starts from 0, so the first error inside the window shows
                dq = self._samples[name] = deque([(self.time.started_at or now, 0.0)])
            if not dq or dq[-1][1] != total or now - dq[-1][0] > self.window_s / 4:
                dq.append((now, total))
            while len(dq) > 1 and dq[1][0] <= now - self.window_s:
                dq.popleft()
            due = dq[-1][0] + self.window_s / 4
            if len(dq) > 1:
                due = min(due, dq[1][0] + self.window_s)
            quiet = min(quiet, due - 1.0)
        self._quiet_until = quiet
        self._seen = tuple(map(totals.get, self.names))

    def increase(self, name: str) -> float | None:
        """Increase of a health counter over the window (None before any sample)."""
        dq = self._samples.get(name)
        total = self.health.total(name)
        if not dq or total is None:
            return None  # no series on /metrics either: Prometheus reads no data, so do we
        return max(0.0, total - dq[0][1])  # dq[0] is the last sample at or before the window start

    def increase_since(self, name: str, since: float) -> float | None:
        """Increase of a health counter since input time ``since`` (inside the window): from the
        last sample at or before it, as :meth:`increase` reads from the window's start."""
        dq = self._samples.get(name)
        total = self.health.total(name)
        if not dq or total is None:
            return None
        start = dq[0][1]
        for ts, value in dq:
            if ts > since:
                break
            start = value
        return max(0.0, total - start)
