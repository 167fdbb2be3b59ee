"""When each check began breaching: the exporter's stand-in for Prometheus's ``activeAt``.

Prometheus turns a breach into a *pending* alert and, after the alert's ``for``, a *firing*
one. Without Prometheus the console still needs to tell the two apart, so the exporter keeps,
per check, the time of the first evaluation that found it past its limit; an evaluation that
finds it within its limit (or unmeasured) forgets it, as Prometheus resets a pending alert.

The record advances on the exporter's own clock (``exporter.loops.breach_loop`` evaluates every few
seconds, as Prometheus evaluates its rules), never because someone asked: ``/api/v1/groups``
only reads it. Thread-safe: the loop writes while API requests read.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from prefixscope.diagnosis import FIRING, OK, SETTLE_S, Status


class BreachClock:
    def __init__(self) -> None:
        self._since: dict[str, float] = {}
        # check key -> since when its value over the short window (SETTLE_WINDOW) is within its limit
        self._within: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, statuses: Mapping[str, Status], now: float) -> dict[str, float]:
        """Record one evaluation's statuses; returns check key → breaching since (breaching ones)."""
        with self._lock:
            for key, status in statuses.items():
                if status == FIRING:
                    since = self._since.setdefault(key, now)
                    if since > now:  # a clock that went back (replayed input time): start again
                        self._since[key] = now
                else:
                    self._since.pop(key, None)
            return dict(self._since)

    def since(self) -> dict[str, float]:
        """Check key → when it began breaching, as of the latest evaluation (reads only)."""
        with self._lock:
            return dict(self._since)

    def observe_recent(self, statuses: Mapping[str, Status], now: float) -> None:
        """Record one evaluation of the checks over the short window (``checks.recent_statuses``):
        a check within its limit keeps the time it got there; breaching or unmeasured forgets it."""
        with self._lock:
            for key, status in statuses.items():
                if status == OK:
                    since = self._within.setdefault(key, now)
                    if since > now:
                        self._within[key] = now
                else:
                    self._within.pop(key, None)

    def settled(self, now: float, settle_s: float = SETTLE_S) -> frozenset[str]:
        """Checks breaching on their window whose short-window value has been within the limit for
        ``settle_s`` (prefixscope.diagnosis: SETTLE_S) as of the latest evaluations."""
        with self._lock:
            return frozenset(k for k, t in self._within.items() if k in self._since and now - t >= settle_s)

    def within_since(self) -> dict[str, float]:
        """Check key → since when its short-window value is within its limit (reads only)."""
        with self._lock:
            return dict(self._within)
