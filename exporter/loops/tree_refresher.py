"""The background thread that keeps the tree statistics fresh, so no /metrics scrape computes them.

At most every ``interval`` seconds it calls ``ClusterState.refresh_tree_stats``, which does
nothing while the index is unchanged; otherwise it reads the statistics under the state lock in
short steps (every statistic, leaf depths included, is kept at apply time: a reading settles
the depth shifts left queued and copies the counters and histograms; no walk, no copy) and
builds the result outside it. /metrics and the API serve the latest completed reading, at most
about ``interval`` plus one reading old.
"""

from __future__ import annotations

import logging

from exporter.core.index.prefix_index import CORE, PrefixIndex
from exporter.core.state import ClusterState
from exporter.loops.duty_clock import DutyClock
from exporter.loops.periodic import Periodic, PeriodicJob

log = logging.getLogger("prefixscope.tree_stats")

DEFAULT_INTERVAL_S = 1.0


class TreeStatsRefresher(PeriodicJob):
    """``start()`` runs the refresher thread (one pass right away); ``close()`` stops it."""

    def __init__(self, state: ClusterState, interval: float = DEFAULT_INTERVAL_S,
                 duties: DutyClock | None = None) -> None:
        self.state = state
        self.interval = interval
        self.duties = duties or DutyClock()  # each reading is one batch of the tree_statistics duty
        self._loop = Periodic("tree statistics", interval,
                              self.duties.wrap("tree_statistics", lambda: self.state.refresh_tree_stats()), log,
                              "/metrics keeps the previous statistics")

    def start(self) -> TreeStatsRefresher:
        log.info("prefix index: the %s core (%s); tree statistics at most every %gs",
                 CORE, PrefixIndex.__name__, self.interval)
        self._loop.start()
        return self
