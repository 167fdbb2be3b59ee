"""Time as the inputs tell it: the newest input timestamp seen, and the first.

Windows, health recency and pool changes run on this clock (record ``ts``, batch receive time,
scrape time), never on the wall clock, so live ingestion and accelerated replay run the same
code. The state's parts share one instance; it only moves forward.
"""

from __future__ import annotations


class InputTime:
    __slots__ = ("now", "started_at")

    def __init__(self) -> None:
        self.now = 0.0  # newest input timestamp
        self.started_at: float | None = None  # the first one

    def advance(self, ts: float) -> None:
        if self.started_at is None:
            self.started_at = ts
        if ts > self.now:
            self.now = ts
