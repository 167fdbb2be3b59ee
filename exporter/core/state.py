"""ClusterState: the exporter's pure core. Sources call it (``StateSink``); the collector, the
checks and the JSON API read it.

The state is a facade over parts that each hold one thing, built before it and handed in
(``exporter.core.state_parts``), all on the same input-time clock (``exporter.core.input_time``)
and all guarded by the state's one lock — sources hand over whole batches, so it is taken once
per batch. Readers use the parts by name:

- ``store`` (``exporter.core.metric_store``): every counter and histogram of the catalogue, kept
  twice — cumulative for /metrics and in a sliding window for the exporter's own checks;
- ``worker_pool`` (``exporter.core.worker_pool``): known workers and routers, the healthy set, pool
  changes, which down targets have left the pool, and what a worker is (capacity, block size);
- ``accounting`` (``exporter.core.record_accounting``): what one request record adds to which series;
- ``kv`` (``exporter.core.kv_accounting``): what one KV-event batch does, and whether each view is true;
- ``scrapes`` (``exporter.core.scrape_accounting``): what a worker's or router's scrape adds, and
  the readings built on a worker's counters (hit ratio, effective cache value);
- ``hotspots`` (``exporter.core.hotspots``): the hit and new-session history behind hot branches and
  "what changed";
- ``index``, ``sessions``, ``attribution``, ``health_increases``, and ``time`` (``time.now``: the
  newest input timestamp);
- the series view (``exporter.core.series_view``): the ``Series`` snapshot the collector renders.

The state itself takes the lock, advances the input time, hands each input to its part, and brings the pool and
the windows up to date after each input. Tree statistics (depths, fan-out, duplication) are never
computed by a reader: ``refresh_tree_stats`` reads them under the lock in short holds (the
compiled index keeps the counters at apply time and walks its live tree for the depths, a slice
per hold — the only ingest pause) and builds the result outside it; /metrics, the checks and the
API read the latest completed one. The exporter's runtime calls it in the background
(``exporter.loops.tree_refresher``); tests and offline replays call it explicitly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from exporter.core.health import Health
from exporter.core.hotspots import HISTORY_S, branch_label
from exporter.core.index.prefix_index import TreeStats, compute_stats, pass_in_slices
from exporter.core.kv_accounting import KV_LAST_TS
from exporter.core.membership import Membership
from exporter.core.record_slice import RecordInput, apply_records
from exporter.core.series_view import Series, build_series
from exporter.core.state_parts import StateParts, build_parts
from exporter.model import KvBatch, RouterSnapshot, WorkerSnapshot
from prefixscope import catalog
from prefixscope.records import RequestRecord
from prefixscope.thresholds import Thresholds
from prefixscope.topology import Topology

__all__ = ["NO_TREE", "TREE_CHILDREN_DEPTH", "ClusterState", "Series", "TreeStatsTiming",
           "branch_label"]

P = catalog.NAMESPACE
# Radix edges whose runs and child lists every statistics pass keeps: the API's default tree depth,
# which also covers the hot branches' runs (radix depth ≤ 2). A deeper tree request runs a pass of its own.
TREE_CHILDREN_DEPTH = 4
NO_TREE = TreeStats(version=-1)  # before the first pass: no branching known, chains map to their first block

_POOL_CHANGES = catalog.METRICS_BY_NAME[f"{P}_worker_pool_changes"].name

T = TypeVar("T")


@dataclass(frozen=True)
class TreeStatsTiming:
    """Cost of the latest statistics reading: its steps under the state lock (all of them, and the
    longest, which is the ingest pause), and the rest outside it."""

    held_s: float
    pass_s: float
    blocks: int
    max_hold_s: float = 0.0
    slices: int = 1


class ClusterState:
    """The cluster-wide prefix index, session table and windows behind every exported number."""

    def __init__(self, parts: StateParts) -> None:
        self.health = parts.health
        self.thresholds = parts.thresholds
        self.topology = parts.topology
        self.clock = parts.clock
        self.top_k = parts.top_k
        self.lock = parts.lock
        self.time = parts.time
        self.index = parts.index
        self.sessions = parts.sessions
        self.store = parts.store
        self.worker_pool = parts.worker_pool
        self.hotspots = parts.hotspots
        self.accounting = parts.accounting
        self.attribution = parts.attribution
        self.kv = parts.kv
        # workers that discovery or a reload adds and drops (``exporter.follow``)
        self.membership = Membership(parts.worker_pool, parts.kv, parts.store, parts.health,
                                     parts.accounting.labels, parts.time, parts.lock, self._update_pool)
        self.scrapes = parts.scrapes
        self.health_increases = parts.health_increases
        self.shard = parts.shard
        self._window_s = parts.window_s
        self._run_window = parts.run_window
        self._tree_stats: TreeStats | None = None  # the latest completed pass (swapped whole)
        self._refresh_lock = threading.Lock()  # one pass at a time
        self.tree_stats_timing: TreeStatsTiming | None = None

    @classmethod
    def build(cls, health: Health, thresholds: Thresholds, topology: Topology | None = None,
              **options: Any) -> ClusterState:
        """A state with parts of its own (``exporter.core.state_parts.build_parts``' arguments)."""
        return cls(build_parts(health, thresholds, topology, **options))

    def set_topology(self, topology: Topology | None) -> None:
        """Place the workers by ``topology`` from now on: the topology file's workers and the ones
        discovery placed (``prefixscope.topology.with_discovered``). Every part that reads a
        worker's node, domain, class or warm-pool membership reads the new one; what was counted
        stays counted."""
        with self.lock:
            if topology == self.topology:
                return
            self.topology = topology
            self.worker_pool.topology = topology
            self.accounting.set_topology(topology)
            self.kv.set_topology(topology)

    @property
    def window_s(self) -> float:
        """The window the reads cover: the configured one, or (a replay's) the whole run so far."""
        if not self._run_window:
            return self._window_s
        now = self.time
        return max(1.0, now.now - (now.started_at if now.started_at is not None else now.now))

    # ---- after every input (under the lock) ----------------------------------------------------
    def _expire(self) -> None:
        now = self.time.now
        if self.worker_pool.departed:
            self.membership.retire(now)
        self.health_increases.sample()
        self.store.expire(now)
        self.accounting.expire_labels(now)
        self.hotspots.expire(now)
        self.sessions.expire(now, HISTORY_S)

    def _update_pool(self, ts: float) -> None:
        if self.worker_pool.update(ts):
            self.store.inc(ts, _POOL_CHANGES, ())

    # ---- StateSink -----------------------------------------------------------------------------
    def apply_kv_batch(self, batch: KvBatch, received_at: float, stream: bool = True) -> None:
        """``stream`` False (a family shard that is not the worker's home, exporter.core.sharding): apply
        the events but leave the worker's stream-health series (batches, lag, last timestamp) to its
        home shard, so each exists once across shards."""
        with self.lock:
            now = self.time
            if received_at > now.now or now.started_at is None:  # (else advancing changes nothing)
                now.advance(received_at)
            applied = self.kv.apply(batch, received_at)
            if batch.sessions is not None and stream:  # stores that name their session (vLLM >= 0.30)
                self.accounting.kv_sessions(batch.worker, batch.sessions, received_at)
            if not self.worker_pool.unchanged_for(batch.worker) and self.worker_pool.note(batch.worker, received_at):
                self.store.inc(received_at, _POOL_CHANGES, ())
            self._expire()
        self.kv.settle(applied, stream)

    def worker_restarted(self, worker: str, stream: bool = True) -> None:
        """``stream`` False: clear the view without counting the restart (counted by the home shard)."""
        self.kv.worker_restarted(worker, stream)

    def reset_view(self, worker: str) -> None:
        """Forget the worker's view before a rebuild (not a restart: nothing is counted)."""
        self.kv.reset_view(worker)

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """Count one repair; ``reliable`` False leaves the view marked until a complete rebuild, a cache reset or a restart."""
        self.kv.view_repaired(worker, reason, reliable)

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        with self.lock:
            self.time.advance(scraped_at)
            self.scrapes.worker(snapshot, scraped_at)
            # One worker's scrape: the pool is brought up to date for it alone (no walk over all
            # workers per scrape, which made a round O(W²)).
            if self.worker_pool.note(snapshot.worker, scraped_at):
                self.store.inc(scraped_at, _POOL_CHANGES, ())
            self._expire()
            self._idle_is_fresh(snapshot, scraped_at)
            drift = self.kv.drift_after_scrape(snapshot.worker)
        if drift is not None:
            self.kv.repair(snapshot.worker, drift)

    def _idle_is_fresh(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        """An idle worker has no KV events to send: its stream is current as of this scrape, not
        stale. Idle is nothing running and no prefix-cache query since the first scrape after its
        last batch (or the last such refresh) — not merely since the previous scrape: a worker that
        served between its last batch and now owes events, and a lull between two of its scrapes
        must not pass a stream that dropped them for a fresh one. Under the state's lock."""
        last = self.health.gauges.get(KV_LAST_TS, {}).get((snapshot.worker,))
        queries = snapshot.prefix_queried_tokens
        if last is None or queries is None:
            return
        w = self.worker_pool.worker(snapshot.worker, scraped_at)
        mark = w.quiet_mark
        if mark is None or mark[0] != last:  # a batch since: this scrape's count is the baseline
            w.quiet_mark = (last, queries)
            return
        if snapshot.running == 0 and queries == mark[1] and last < scraped_at:
            self.health.set(KV_LAST_TS, (snapshot.worker,), scraped_at)
            w.quiet_mark = (scraped_at, queries)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        with self.lock:
            self.time.advance(scraped_at)
            self.scrapes.router(snapshot, scraped_at)
            self._update_pool(scraped_at)
            self._expire()

    def signal_seen(self, signal: str, ts: float) -> None:
        """A source other than records or scrapes carried ``signal`` at ``ts`` (e.g. OTLP spans)."""
        with self.lock:
            self.accounting.field_seen[signal] = max(ts, self.accounting.field_seen.get(signal, 0.0))

    def ingest_records(self, records: Iterable[RecordInput], received_at: float) -> None:
        """Request records that passed the ``prefixscope.request/v1`` schema.

        The intake hands over :class:`RequestRecord` values; a plain JSON object (replays, tests,
        the lab) is converted here, and one that cannot be is counted and skipped.
        """
        labels = self.accounting.labels
        with self.lock:
            self.time.advance(received_at)
            folded = labels.folded()
            now = self.time.now
            # Workers whose records cannot change the pool (the pool, the input time and the
            # scrape targets' up states stay as they are until the loop ends), and the others:
            # the pool judges those alone once the records are in (no walk over the workers).
            unchanged: set[str] = set()
            judge: set[str] = set()
            with self.store.batch():  # counter writes once per key and slot, at the end
                apply_records(self.accounting, self.attribution.records, self.kv.evictions, self.worker_pool,
                              self.health, records, now, unchanged, judge)
            if judge and self.worker_pool.note_all(judge, now):
                self.store.inc(now, _POOL_CHANGES, ())
            self._expire()
            folded = labels.folded() - folded
        if folded:
            self.health.error("records", "label_limit", f"{folded} record(s) named a model, segment or worker "
                              "beyond the configured limits (limits:); counted under the value \"other\"", folded)

    def observe_cold_baselines(self, records: Iterable[RequestRecord], received_at: float) -> None:
        """Records another family shard keeps: only their cold prefill, into the cold-prefill
        baseline (exporter.core.sharding.ShardRecords)."""
        with self.lock:
            self.time.advance(received_at)
            for rec in records:
                self.accounting.observe_cold_baseline(rec)

    # ---- reads (callers hold no lock; each takes it once) --------------------------------------
    def signals(self) -> dict[str, bool]:
        with self.lock:
            return self.signals_locked()

    def signals_locked(self) -> dict[str, bool]:
        """Which signals are available now (the caller holds the lock)."""
        cutoff = self.time.now - self.window_s
        out = {name: False for name in catalog.SIGNALS}
        for signal, ts in self.accounting.field_seen.items():
            out[signal] = ts > cutoff
        out["kv_events"] = self.kv.seen
        out["kv_token_ids"] = self.kv.roots.tokens_seen
        out["worker_metrics"] = any(w.snapshot is not None for w in self.worker_pool.workers.values())
        out["spec_decode"] = self.scrapes.spec_seen
        out["router_metrics"] = bool(self.worker_pool.routers)
        out["topology"] = self.topology is not None
        out["placements"] = out["block_hashes"] or (self.kv.seen and self.topology is not None)
        out["warm_pool"] = self.topology is not None and bool(self.topology.warm_pool)
        # session keys (records, spans) say it per session; the router's policy branches, per key
        out["affinity_outcomes"] = out["affinity_outcomes"] or out["session_key"]
        return out

    def tree_stats(self) -> TreeStats | None:
        """The latest completed statistics pass (None before the first one): never computes."""
        return self._tree_stats

    def refresh_tree_stats(self) -> TreeStats:
        """Run a statistics pass now if the index changed since the latest one; return the latest.

        Only the reading's steps hold the state lock, in short slices (``pass_in_slices``); the
        result is built outside it and swapped in whole, so readers see either the previous one or this one.
        """
        with self._refresh_lock:  # a concurrent caller waits, then finds the statistics current
            with self.lock:
                latest = self._tree_stats
                if latest is not None and latest.version == self.index.version:
                    return latest
            tree, held = pass_in_slices(self.index, self.lock)
            t1 = time.perf_counter()
            stats = compute_stats(tree, TREE_CHILDREN_DEPTH)
            self.tree_stats_timing = TreeStatsTiming(held.total_s, time.perf_counter() - t1, stats.blocks,
                                                     held.max_hold_s, held.slices)
            self._tree_stats = stats
            return stats

    def tree_stats_with_children(self, depth: int) -> TreeStats | None:
        """The latest statistics if they keep the runs ``depth`` edges deep, else a pass of
        their own for this one request (stepped under the lock, built outside it).
        None before the first pass: the tree is missing until the statistics exist."""
        latest = self._tree_stats
        if latest is None or latest.children_depth >= depth:
            return latest
        with self._refresh_lock:  # one reading at a time (each holds its walk's working memory)
            tree, _held = pass_in_slices(self.index, self.lock)
        return compute_stats(tree, depth)

    def session_hit_ratios(self) -> list[float]:
        cutoff = self.time.now - self.window_s
        return self.sessions.hit_ratios_since(cutoff)

    def branch_hits(self, start: float, end: float, stats: TreeStats | None = None) -> dict[int, tuple[float, set]]:
        """Hit tokens and sessions per branch for hits with start < ts ≤ end."""
        return self.hotspots.branch_hits(start, end, stats or self._tree_stats or NO_TREE)

    def hot_branches(self, k: int | None = None, stats: TreeStats | None = None) -> list[tuple[int, float, int]]:
        """Top-k branches of the window: (first block, hit tokens, sessions)."""
        now = self.time.now
        return self.hotspots.hot_branches(self.top_k if k is None else k, now - self.window_s, now,
                                          stats or self._tree_stats or NO_TREE)

    def hot_branch_tokens(self, stats: TreeStats | None = None) -> list[tuple[int, float]]:
        """Top-k branches of the window by hit tokens, kept incrementally (what /metrics renders)."""
        now = self.time.now
        return self.hotspots.hot_branch_tokens(self.top_k, now - self.window_s, now,
                                               stats or self._tree_stats or NO_TREE)

    def snapshot_for(self, fn: Callable[[ClusterState], T]) -> T:
        """Run a read under the lock (the collector and API builders use this)."""
        with self.lock:
            self._expire()
            return fn(self)

    def workers_seen(self) -> list[str]:
        names = set(self.worker_pool.workers) | set(self.index.workers)
        return sorted(names)

    # ---- current series (the collector renders them; the checks read them) ---------------------
    def series(self) -> Series:
        """Every catalogue series as plain data, from the state and the exporter's Health."""
        return build_series(self)
