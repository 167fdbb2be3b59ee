"""The background loop that advances the breach record on the exporter's own clock.

Every ``interval`` seconds it evaluates the checks (``exporter.checks.evaluate``, at the state's
clock) and records which breach (``exporter.breaches.BreachClock``), so a breach that starts
between two ``/api/v1/groups`` requests is recorded when it starts, not when someone next asks.
Like Prometheus's rule evaluation, a breach's start is known to within one interval.
"""

from __future__ import annotations

import logging
import threading

from exporter.breaches import BreachClock
from exporter.checks import evaluate
from exporter.state import ClusterState

log = logging.getLogger("prefixscope.breaches")

DEFAULT_INTERVAL_S = 5.0


class BreachLoop:
    """``start()`` runs the loop (one evaluation right away); ``close()`` stops it.
    ``evaluate_once()`` is one step, for callers that drive time themselves (tests, replays)."""

    def __init__(self, state: ClusterState, record: BreachClock, interval: float = DEFAULT_INTERVAL_S) -> None:
        if interval <= 0:
            raise ValueError(f"breach evaluation interval must be > 0, got {interval}")
        self.state = state
        self.record = record
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def evaluate_once(self) -> dict[str, float]:
        """Evaluate every check now and advance the record; returns check key → breaching since."""
        ev = evaluate(self.state)
        return self.record.observe({key: r.status for key, r in ev.results.items()}, ev.evaluated_at)

    def start(self) -> BreachLoop:
        if self._thread is not None:
            raise RuntimeError("breach loop already started")
        log.info("checks evaluated every %gs for pending and firing alerts", self.interval)
        self._thread = threading.Thread(target=self._run, name="prefixscope-breaches", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; an evaluation in progress finishes first (bounded by ``timeout``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("breach loop did not stop within %.1fs", timeout)

    def _run(self) -> None:
        failed = False
        while True:
            try:
                self.evaluate_once()
                failed = False
            except Exception:  # an exporter bug, not bad input: log it once per run of failures, keep going
                if not failed:
                    log.exception("check evaluation failed; the breach record keeps its previous state")
                failed = True
            if self._stop.wait(self.interval):
                return
