"""Clocks: everything in the fleet that models time takes one.

The demo runs on :class:`RealClock`; tests and scenario replays run on :class:`VirtualClock`,
which only moves when told to, so a 10-minute scenario runs in seconds and is reproducible.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Current time in Unix seconds."""

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on this clock."""


class RealClock:
    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """A clock that advances only through :meth:`advance` / :meth:`sleep` / :meth:`set`.

    The default start (1.8e9, year 2027) keeps timestamps realistic for Prometheus and for
    record schemas without depending on the wall clock.
    """

    def __init__(self, start: float = 1.8e9) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, t: float) -> float:
        """Jump forward to ``t`` (no-op if ``t`` is in the past)."""
        with self._lock:
            self._now = max(self._now, float(t))
            return self._now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.advance(seconds)
