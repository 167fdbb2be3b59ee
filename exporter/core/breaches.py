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

from prefixscope.diagnosis import FIRING, Status


class BreachClock:
    def __init__(self) -> None:
        self._since: dict[str, float] = {}
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
