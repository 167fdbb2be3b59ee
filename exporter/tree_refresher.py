"""The background thread that keeps the tree statistics fresh, so no /metrics scrape computes them.

At most every ``interval`` seconds it calls ``ClusterState.refresh_tree_stats``, which does
nothing while the index is unchanged; otherwise it copies the tree under the state lock and
runs the pass outside it. /metrics and the API serve the latest completed pass, at most about
``interval`` plus one pass old.
"""

from __future__ import annotations

import logging
import threading

from exporter.prefix_index import CORE, PrefixIndex
from exporter.state import ClusterState

log = logging.getLogger("prefixscope.tree_stats")

DEFAULT_INTERVAL_S = 1.0


class TreeStatsRefresher:
    """``start()`` runs the refresher thread (one pass right away); ``close()`` stops it."""

    def __init__(self, state: ClusterState, interval: float = DEFAULT_INTERVAL_S) -> None:
        if interval <= 0:
            raise ValueError(f"tree statistics interval must be > 0, got {interval}")
        self.state = state
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TreeStatsRefresher:
        if self._thread is not None:
            raise RuntimeError("tree statistics refresher already started")
        log.info("prefix index: the %s core (%s); tree statistics at most every %gs",
                 CORE, PrefixIndex.__name__, self.interval)
        self._thread = threading.Thread(target=self._run, name="prefixscope-tree-stats", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; a pass in progress finishes first (bounded by ``timeout``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("tree statistics refresher did not stop within %.1fs", timeout)

    def _run(self) -> None:
        failed = False
        while True:
            try:
                self.state.refresh_tree_stats()
                failed = False
            except Exception:  # an exporter bug, not bad input: log it once per run of failures, keep going
                if not failed:
                    log.exception("tree statistics pass failed; /metrics keeps the previous statistics")
                failed = True
            if self._stop.wait(self.interval):
                return
