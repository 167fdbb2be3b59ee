"""The background loop that advances the breach record on the exporter's own clock.

Every ``interval`` seconds it evaluates the checks (``exporter.core.checks.evaluate``, at the state's
clock) and records which breach (``exporter.core.breaches.BreachClock``), so a breach that starts
between two ``/api/v1/groups`` requests is recorded when it starts, not when someone next asks; and
which are back within their limits over the last minute, so a breach that ended settles.
Like Prometheus's rule evaluation, a breach's start is known to within one interval.
"""

from __future__ import annotations

import logging

from exporter.core.breaches import BreachClock
from exporter.core.checks import evaluate, recent_statuses
from exporter.core.state import ClusterState
from exporter.loops.duty_clock import DutyClock
from exporter.loops.periodic import Periodic, PeriodicJob

log = logging.getLogger("prefixscope.breaches")

DEFAULT_INTERVAL_S = 5.0


class BreachLoop(PeriodicJob):
    """``start()`` runs the loop (one evaluation right away); ``close()`` stops it.
    ``evaluate_once()`` is one step, for callers that drive time themselves (tests, replays)."""

    def __init__(self, state: ClusterState, record: BreachClock, interval: float = DEFAULT_INTERVAL_S,
                 duties: DutyClock | None = None) -> None:
        self.state = state
        self.record = record
        self.duties = duties or DutyClock()  # each background evaluation is one batch of the breach duty
        self._loop = Periodic("breach loop", interval, self.duties.wrap("breach", lambda: self.evaluate_once()), log,
                              "the breach record keeps its previous state")
        self.interval = interval

    def evaluate_once(self) -> dict[str, float]:
        """Evaluate every check now and advance the record; returns check key → breaching since."""
        ev = evaluate(self.state)
        since = self.record.observe({key: r.status for key, r in ev.results.items()}, ev.evaluated_at)
        # the same checks over the last minute: a breach that ended settles (prefixscope.diagnosis)
        self.record.observe_recent(recent_statuses(self.state, now=ev.evaluated_at), ev.evaluated_at)
        return since

    def start(self) -> BreachLoop:
        log.info("checks evaluated every %gs for pending and firing alerts", self.interval)
        self._loop.start()
        return self
