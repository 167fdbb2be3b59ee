"""ClusterState: the exporter's pure core. Sources call it (``StateSink``); the collector, the
checks and the JSON API read it.

All maths happens here on plain values: the prefix index and tree, the session table, and
every counter and histogram of the catalogue, each kept twice — cumulative for /metrics and
in a sliding window (keyed by input timestamps) for the exporter's own check evaluation.
One lock guards everything; sources hand over whole batches, so it is taken once per batch.

Tree statistics (depths, fan-out, duplication) are never computed by a reader: ``refresh_tree_stats``
copies the tree under the lock (C-level copies, the only ingest pause) and runs the pass outside
it; /metrics, the checks and the API read the latest completed pass. The exporter's runtime calls
it in the background (``exporter.tree_refresher``); tests and offline replays call it explicitly.

KV-event stream health split: sources count what they see on the wire (sequence gaps, missed
batches, replays, decode errors); the state counts what applying the events did (batches,
events applied, unknown parents and removals, restarts, last batch time and lag).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from exporter.health import Health
from exporter.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    RouterSnapshot,
    WorkerSnapshot,
)
from exporter.prefix_index import PrefixIndex, TreeStats, compute_stats
from exporter.sessions import SessionTable
from exporter.windows import Cumulative, LabelValues, WindowedBuckets, WindowedSum
from prefixscope import __version__, catalog

P = catalog.NAMESPACE
DEFAULT_BLOCK_SIZE = 16  # vLLM's default, used only when neither the record nor the worker says
HISTORY_S = 3600.0  # how far back /api/v1/changes can look
MAX_HISTORY_EVENTS = 200_000
UNKNOWN = "unknown"
# Radix edges whose runs and child lists every statistics pass keeps: the API's default tree depth,
# which also covers the hot branches' runs (radix depth ≤ 2). A deeper tree request runs a pass of its own.
TREE_CHILDREN_DEPTH = 4
NO_TREE = TreeStats(version=-1)  # before the first pass: no branching known, chains map to their first block

# Record field -> the signal it feeds (catalog.SIGNALS); a field counts once any record carried it.
RECORD_FIELD_SIGNALS: dict[str, str] = {
    "session_key": "session_key",
    "block_hashes": "block_hashes",
    "cached_tokens": "cached_tokens",
    "predicted_cached_tokens": "predicted_cached_tokens",
    "prefill_s": "prefill_timing",
    "async_wait_s": "async_prefill",
    "walk_s": "walk_latency",
    "migrated_from": "migrations",
    "migration_kind": "migrations",
    "expert_signature": "expert_signature",
    "admitted_by_affinity": "affinity_admission",
}

# Fields that describe an event (a migration, an async-prefill wait): a producer that writes the
# key with null is saying "it did not happen", so the signal is instrumented. Measurement fields
# (cached_tokens, prefill_s, ...) stay missing when null — an engine that leaves cached_tokens null
# (vLLM without --enable-prompt-tokens-details) has not measured it.
EVENT_FIELDS = frozenset({"migrated_from", "migration_kind", "async_wait_s"})
MIGRATION_KINDS = ("soft", "hard")

# WorkerSnapshot counter field -> catalogue counter it is exported as (labels worker, model).
SNAPSHOT_COUNTERS: dict[str, str] = {
    "prefix_queried_tokens": f"{P}_prefix_cache_queried_tokens",
    "prefix_hit_tokens": f"{P}_prefix_cache_hit_tokens",
    "spec_draft_tokens": f"{P}_spec_decode_draft_tokens",
    "spec_accepted_tokens": f"{P}_spec_decode_accepted_tokens",
}


def _m(name: str) -> catalog.Metric:
    return catalog.METRICS_BY_NAME[f"{P}_{name}"]


# Series every KV batch updates, looked up in the catalogue once (a missing one fails at import).
_KV_BATCHES = _m("kv_event_batches").name
_KV_APPLIED = _m("kv_events_applied").name
_KV_UNKNOWN_PARENT = _m("kv_event_unknown_parent").name
_KV_UNKNOWN_REMOVALS = _m("kv_event_unknown_block_removals").name
_KV_MISSED = _m("kv_event_missed_batches").name
_KV_LAST_TS = _m("kv_event_last_timestamp_seconds").name
_KV_LAG = _m("kv_event_lag_seconds").name
_WORKER_RESTARTS = _m("worker_restarts").name
_INGEST_ERRORS = _m("ingest_errors").name
_UP = _m("up").name
_STORED, _REMOVED, _CLEARED = BlockStored.__name__, BlockRemoved.__name__, AllBlocksCleared.__name__  # event label


def branch_label(block: int) -> str:
    """A branch as shown on /metrics: the first 8 hex digits of its first block's 64-bit hash."""
    return f"{block & 0xFFFFFFFFFFFFFFFF:016x}"[:8]


@dataclass
class WorkerInfo:
    name: str
    last_seen: float = 0.0  # newest evidence of life: record served, scrape, KV batch
    last_served: float = 0.0  # newest evidence of traffic: a record, or a router decision count rising
    snapshot: WorkerSnapshot | None = None
    scraped_at: float | None = None
    block_size: int | None = None
    last_counters: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TreeStatsTiming:
    """Cost of the latest statistics pass: the copy under the state lock, and the pass outside it."""

    copy_s: float
    pass_s: float
    blocks: int


@dataclass
class PoolChange:
    ts: float
    before: int
    after: int
    epoch: int
    seen_both: int = 0  # sessions served before and after this change
    moved: int = 0  # ... whose worker changed

    @property
    def reshuffled_share(self) -> float | None:
        return self.moved / self.seen_both if self.seen_both else None


class ClusterState:
    """The cluster-wide prefix index, session table and windows behind every exported number."""

    def __init__(self, health: Health, thresholds: Any, topology: Any = None, window_s: float = 300.0,
                 clock: Callable[[], float] = time.time, top_k: int = 10, max_sessions: int = 100_000,
                 health_recency_s: float = 60.0) -> None:
        self.health = health
        self.thresholds = thresholds
        self.topology = topology
        self.window_s = float(window_s)
        self.clock = clock
        self.top_k = top_k
        self.health_recency_s = health_recency_s
        self.down_since: dict[tuple[str, ...], float] = {}  # (target, kind) -> first failing observation
        self.cold_reuse_share = float(getattr(thresholds, "cold_reuse_share", 0.1))
        self.lock = threading.Lock()
        self.index = PrefixIndex()
        self._tree_stats: TreeStats | None = None  # the latest completed pass (swapped whole)
        self._refresh_lock = threading.Lock()  # one pass at a time
        self.tree_stats_timing: TreeStatsTiming | None = None
        self.sessions = SessionTable(max_sessions=max_sessions)
        self.cum = Cumulative()
        self.win = WindowedSum(self.window_s)  # key (metric, labels)
        self.hwin: dict[str, WindowedBuckets] = {}
        self.long_hwin: dict[tuple[str, float], WindowedBuckets] = {}
        self.now = 0.0  # newest input timestamp
        self.started_at: float | None = None
        self.workers: dict[str, WorkerInfo] = {}
        self.routers: dict[str, RouterSnapshot] = {}
        self.kv_seen = False
        self.spec_seen = False
        self.field_seen: dict[str, float] = {}
        self.fallback_last: dict[str, float] = {}
        self.moe_signature: OrderedDict[int, str] = OrderedDict()
        self.hit_events: deque[tuple[float, tuple[int, ...], float, str | None]] = deque(maxlen=MAX_HISTORY_EVENTS)
        self.session_events: deque[tuple[float, str, bool]] = deque(maxlen=MAX_HISTORY_EVENTS)
        self.pool: frozenset[str] = frozenset()
        self._pool_stable_until = -math.inf  # input time until which no pool member can age out
        self._pool_up_writes = -1  # Health's write count of the up gauges at the last pool update
        self._kv_workers: set[str] = set()  # workers whose KV health series exist
        self.pool_epoch = 0
        self.pool_changes: deque[PoolChange] = deque(maxlen=100)
        self._reshuffle_counted: dict[str, int] = {}
        self._health_samples: dict[str, deque[tuple[float, float]]] = {}
        for rule in catalog.RECORDING_RULES:  # histograms some rule reads over a longer window
            if "[1h]" in rule.expr:
                for m in catalog.METRICS:
                    if m.buckets and f"{m.name}_bucket" in rule.expr:
                        self.long_hwin[(m.name, 3600.0)] = WindowedBuckets(3600.0, m.buckets)

    # ---- primitives --------------------------------------------------------------------------
    def _advance(self, ts: float) -> None:
        if self.started_at is None:
            self.started_at = ts
        if ts > self.now:
            self.now = ts

    def _inc(self, ts: float, metric: str, labels: LabelValues, value: float = 1.0) -> None:
        self.cum.inc(metric, labels, value)
        self.win.add(ts, (metric, labels), value)

    def _zero(self, metric: str, labels: LabelValues) -> None:
        """Create a counter series at 0: a ratio's numerator exists whenever its denominator does."""
        self.cum.inc(metric, labels, 0.0)

    def _observe(self, ts: float, metric: str, labels: LabelValues, value: float) -> None:
        m = catalog.METRICS_BY_NAME[metric]
        assert m.buckets is not None
        self.cum.observe(metric, labels, m.buckets, value)
        hw = self.hwin.get(metric)
        if hw is None:
            hw = self.hwin[metric] = WindowedBuckets(self.window_s, m.buckets)
        hw.observe(ts, labels, value)
        lw = self.long_hwin.get((metric, 3600.0))
        if lw is not None:
            lw.observe(ts, labels, value)

    def _expire(self) -> None:
        now = self.now
        self._sample_health()
        self.win.expire(now)
        for hw in self.hwin.values():
            hw.expire(now)
        for lw in self.long_hwin.values():
            lw.expire(now)
        cutoff = now - HISTORY_S
        while self.hit_events and self.hit_events[0][0] <= cutoff:
            self.hit_events.popleft()
        while self.session_events and self.session_events[0][0] <= cutoff:
            self.session_events.popleft()
        self.sessions.expire(now, HISTORY_S)

    def _worker(self, name: str, ts: float | None = None) -> WorkerInfo:
        w = self.workers.get(name)
        if w is None:
            w = self.workers[name] = WorkerInfo(name)
        if ts is not None and ts > w.last_seen:
            w.last_seen = ts
        return w

    def _topo(self, worker: str) -> Any:
        topo = self.topology
        return topo.worker(worker) if topo is not None and worker in topo else None

    # ---- health and pool ---------------------------------------------------------------------
    def _explicitly_down(self) -> set[str]:
        down = {t for (t, _kind), v in dict(self.health.gauges.get(f"{P}_up", {})).items() if v == 0}
        for snap in self.routers.values():
            down.update(w for w, v in snap.healthy.items() if v == 0)
        return down

    def is_healthy(self, worker: str, down: set[str] | None = None) -> bool:
        """Seen alive recently (record, scrape or KV batch) and not reported down by a scrape or router."""
        w = self.workers.get(worker)
        if w is None or self.now - w.last_seen > self.health_recency_s:
            return False
        return worker not in (down if down is not None else self._explicitly_down())

    def _track_down_targets(self) -> None:
        """Remember since when each scrape target has been failing (cleared when it answers again)."""
        for key, v in dict(self.health.gauges.get(f"{P}_up", {})).items():
            if v == 0:
                self.down_since.setdefault(key, self.now)
            else:
                self.down_since.pop(key, None)

    def blind_targets(self) -> int:
        """Targets that fail their scrape while traffic still reaches them.

        A router target that is down always blinds us. A worker target that is down blinds us
        only if it served traffic after its scrapes began to fail (records or router decisions
        show it); a worker whose traffic stopped when it went down has left the pool — a fleet
        event the chain reads in step 2 (migrations, pool changes), not broken telemetry. With no
        traffic source at all (no records, no router) every down target counts: nothing says
        whether it still serves.
        """
        return sum(1 for (target, kind) in self.down_since if not self._left_pool(target, kind))

    def _left_pool(self, target: str, kind: str) -> bool:
        """A down worker target with no traffic since it went down (see :meth:`blind_targets`)."""
        since = self.down_since.get((target, kind))
        if since is None or kind != "worker" or not ("records" in self.field_seen or self.routers):
            return False
        w = self.workers.get(target)
        return w is None or w.last_served <= since

    def _pool_unchanged(self, worker: str) -> bool:
        """True when a KV batch from ``worker`` cannot change the pool (so ``_update_pool`` may be
        skipped): it is in the pool, no member can have aged out yet, and no scrape target changed
        its up state since the last full update (routers change the pool only via observe_router)."""
        return (worker in self.pool and self.now <= self._pool_stable_until
                and self.health.gauge_writes(_UP) == self._pool_up_writes)

    def _update_pool(self, ts: float) -> None:
        self._pool_up_writes = self.health.gauge_writes(_UP)
        self._track_down_targets()
        down = self._explicitly_down()
        pool = frozenset(w for w in self.workers if self.is_healthy(w, down))
        # Members only get fresher, so until then none of them can age out of the pool.
        self._pool_stable_until = min((self.workers[w].last_seen for w in pool), default=-math.inf) \
            + self.health_recency_s
        if pool == self.pool:
            return
        before, self.pool = self.pool, pool
        # While the exporter is still discovering its workers, a growing set is not a change.
        if self.started_at is not None and ts - self.started_at >= self.health_recency_s and before:
            self.pool_epoch += 1
            self.pool_changes.append(PoolChange(ts, len(before), len(pool), self.pool_epoch))
            self._inc(ts, f"{P}_worker_pool_changes", ())

    def _sample_health(self) -> None:
        """Keep (time, total) samples of the health counters the checks read as increase/rate."""
        for name in (_KV_MISSED, _INGEST_ERRORS):
            total = self.health.total(name) or 0.0
            dq = self._health_samples.get(name)
            if dq is None:  # counting starts from 0, so the first error inside the window shows
                dq = self._health_samples[name] = deque([(self.started_at or self.now, 0.0)])
            if not dq or dq[-1][1] != total or self.now - dq[-1][0] > self.window_s / 4:
                dq.append((self.now, total))
            while len(dq) > 1 and dq[1][0] <= self.now - self.window_s:
                dq.popleft()

    def health_increase(self, name: str) -> float | None:
        """Increase of a health counter over the window (None before any sample)."""
        dq = self._health_samples.get(name)
        total = self.health.total(name)
        if not dq or total is None:
            return None  # no series on /metrics either: Prometheus reads no data, so do we
        return max(0.0, total - dq[0][1])  # dq[0] is the last sample at or before the window start

    # ---- StateSink ---------------------------------------------------------------------------
    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        worker = batch.worker
        with self.lock:
            self._advance(received_at)
            self.kv_seen = True
            w = self._worker(worker, received_at)
            res = self.index.apply(worker, batch.events)
            if not w.block_size:
                w.block_size = next((ev.block_size for ev in batch.events
                                     if isinstance(ev, BlockStored) and ev.block_size), None)
            if not self._pool_unchanged(worker):
                self._update_pool(received_at)
            self._expire()
            first = worker not in self._kv_workers
            self._kv_workers.add(worker)
        lab = (worker,)
        # The batch's whole health accounting in one Health call (one lock round trip).
        incs = [(_KV_BATCHES, lab, 1.0)]
        if first:  # these series exist from a worker's first batch: a stream with no gap reads 0, not missing
            incs += [(_WORKER_RESTARTS, lab, 0), (_KV_MISSED, lab, 0), (_KV_UNKNOWN_PARENT, lab, 0),
                     (_KV_UNKNOWN_REMOVALS, lab, 0)]
        if res.unknown_parent:
            incs.append((_KV_UNKNOWN_PARENT, lab, res.unknown_parent))
        if res.unknown_removals:
            incs.append((_KV_UNKNOWN_REMOVALS, lab, res.unknown_removals))
        for name, n in ((_STORED, res.stored_events), (_REMOVED, res.removed_events), (_CLEARED, res.cleared)):
            if n:
                incs.append((_KV_APPLIED, (worker, name), n))
        self.health.update(incs, [(_KV_LAST_TS, lab, received_at),
                                  (_KV_LAG, lab, max(0.0, received_at - batch.ts))])

    def worker_restarted(self, worker: str) -> None:
        with self.lock:
            self.index.clear_worker(worker)
        self.health.inc(f"{P}_worker_restarts", (worker,))

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        with self.lock:
            self._advance(scraped_at)
            w = self._worker(snapshot.worker, scraped_at)
            w.snapshot, w.scraped_at = snapshot, scraped_at
            if snapshot.block_size:
                w.block_size = snapshot.block_size
            model = snapshot.model or UNKNOWN
            prev_queries = w.last_counters.get("prefix_queried_tokens")
            for fld, metric in SNAPSHOT_COUNTERS.items():
                value = getattr(snapshot, fld)
                if value is None:
                    continue
                if fld.startswith("spec_"):
                    self.spec_seen = True
                prev = w.last_counters.get(fld)
                # A counter that went down was reset (engine restart): its new value is the increase.
                delta = value if prev is None or value < prev else value - prev
                w.last_counters[fld] = value
                labels = (snapshot.worker, model)
                self.cum.counters.setdefault(metric, {})[labels] = value
                if prev is not None:
                    self.win.add(scraped_at, (metric, labels), delta)
                    self.win.add(scraped_at, ("worker_delta", fld, snapshot.worker), delta)
            self._update_pool(scraped_at)
            self._expire()
        # An idle worker (nothing running, no prefix-cache query since the last scrape) has no KV
        # events to send: its stream is current as of this scrape, not stale.
        idle = (snapshot.running == 0 and prev_queries is not None
                and snapshot.prefix_queried_tokens == prev_queries)
        last = self.health.gauges.get(f"{P}_kv_event_last_timestamp_seconds", {}).get((snapshot.worker,))
        if idle and last is not None and last < scraped_at:
            self.health.set(f"{P}_kv_event_last_timestamp_seconds", (snapshot.worker,), scraped_at)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        with self.lock:
            self._advance(scraped_at)
            prev = self.routers.get(snapshot.router)
            for worker, n in snapshot.decisions.items():
                if prev is not None and n > prev.decisions.get(worker, 0.0) and worker in self.workers:
                    self.workers[worker].last_served = max(self.workers[worker].last_served, scraped_at)
            self.routers[snapshot.router] = snapshot
            self._update_pool(scraped_at)
            self._expire()

    def ingest_records(self, records: list[dict], received_at: float) -> None:
        with self.lock:
            self._advance(received_at)
            for rec in records:
                try:
                    self._record(rec)
                except (TypeError, ValueError, KeyError) as exc:
                    # Schema-valid records should not fail here; if one does, keep the rest.
                    self.health.error("records", "unprocessable", f"{exc!r} in record {rec.get('request_id')!r}")
            self._update_pool(self.now)
            self._expire()

    # ---- one record ----------------------------------------------------------------------------
    def _record(self, rec: dict) -> None:
        ts = float(rec["ts"])
        self._advance(ts)
        worker = str(rec["worker"])
        prompt = int(rec["prompt_tokens"])
        model = rec.get("model") or UNKNOWN
        ml = (model,)
        for fld, signal in RECORD_FIELD_SIGNALS.items():
            if rec.get(fld) is not None or (fld in EVENT_FIELDS and fld in rec):
                self.field_seen[signal] = ts
        self.field_seen["records"] = ts
        w = self._worker(worker, ts)
        w.last_served = max(w.last_served, ts)
        cached = rec.get("cached_tokens")
        predicted = rec.get("predicted_cached_tokens")
        hashes = rec.get("block_hashes") or None
        bs = int(rec.get("block_size") or w.block_size or DEFAULT_BLOCK_SIZE)
        topo = self.topology

        self._inc(ts, f"{P}_request_prompt_tokens", ml, prompt)
        if cached is not None:
            self._inc(ts, f"{P}_reuse_achieved_tokens", ml, cached)
            self.win.add(ts, ("record_cached", worker), cached)
            self.win.add(ts, ("record_prompt", worker), prompt)
        if predicted is not None:
            self._inc(ts, f"{P}_reuse_predicted_tokens", ml, predicted)
            if cached is not None:
                self._inc(ts, f"{P}_index_staleness_tokens", ml, max(0, predicted - cached))

        hit_on_worker = 0
        if hashes:
            match = self.index.longest_match(hashes)
            hit_on_worker = match.per_worker.get(worker, 0)
            # Availability and placement are judged by what the router faced. A record arrives
            # after its response, when the chosen worker already holds this request's own blocks,
            # so its depth is the cached tokens the engine reported at admission (the other
            # workers' are unaffected). A worker that left the pool holds nothing the router could
            # use, whatever its last view says.
            depths = {w: d for w, d in match.per_worker.items()
                      if w == worker or not self._left_pool(w, "worker")}
            if cached is not None:
                depths[worker] = min(len(hashes), cached // bs)
            best = max(depths.values(), default=0)
            self._inc(ts, f"{P}_reuse_available_tokens", ml, min(prompt, best * bs))
            if topo is not None and best > 0 and worker in topo:
                domains = {topo.domain_of(x) for x, d in depths.items() if d == best and x in topo}
                self._inc(ts, f"{P}_placement_decisions", ml)
                self._zero(f"{P}_placement_domain_hits", ml)
                if topo.domain_of(worker) in domains:
                    self._inc(ts, f"{P}_placement_domain_hits", ml)
            hit_blocks = min(len(hashes), cached // bs) if cached is not None else hit_on_worker
            if hit_blocks:
                self.index.record_hits(hashes, hit_blocks, bs)
                tokens = float(cached) if cached is not None else float(hit_blocks * bs)
                self.hit_events.append((ts, tuple(hashes[:min(hit_blocks, 64)]), tokens, rec.get("session_key")))

        self._session(rec, ts, worker, model, prompt, cached, hashes)
        self._migration(rec, ts, worker)
        self._prefill(rec, ts, worker, model, prompt, cached)

        wait = rec.get("async_wait_s")
        if wait is not None:
            self._observe(ts, f"{P}_async_prefill_wait_seconds", ml, float(wait))
        walk = rec.get("walk_s")
        if walk is not None:
            self._observe(ts, f"{P}_router_tree_walk_seconds", (), float(walk))
        tier = rec.get("fallback_tier")
        if tier:
            self._inc(ts, f"{P}_fallback_requests", (tier,))
            self.fallback_last[tier] = max(ts, self.fallback_last.get(tier, 0.0))
        sig = rec.get("expert_signature")
        if sig is not None and hashes:
            first = hashes[0]
            stored = self.moe_signature.get(first)
            is_hit = (cached > 0) if cached is not None else hit_on_worker > 0
            if stored is None:
                self.moe_signature[first] = sig
                if len(self.moe_signature) > 100_000:
                    self.moe_signature.popitem(last=False)
            elif is_hit:
                self._inc(ts, f"{P}_moe_prefix_hits", ml)
                self._zero(f"{P}_moe_expert_aligned_hits", ml)
                if sig == stored:
                    self._inc(ts, f"{P}_moe_expert_aligned_hits", ml)
        admitted = rec.get("admitted_by_affinity")
        if admitted is not None:
            self._inc(ts, f"{P}_batch_admissions", ml)
            self._zero(f"{P}_batch_affinity_admissions", ml)
            if admitted:
                self._inc(ts, f"{P}_batch_affinity_admissions", ml)

    def _session(self, rec: dict, ts: float, worker: str, model: str, prompt: int,
                 cached: int | None, hashes: list[int] | None) -> None:
        key = rec.get("session_key")
        if not key:
            return
        segment = rec.get("segment") or UNKNOWN
        turn = self.sessions.observe(str(key), ts, worker, hashes, segment, self.pool_epoch)
        ml = (model,)
        prev = turn.previous_worker
        if turn.turn == 1:
            self.session_events.append((ts, segment, turn.rekey_of is not None))
            self._zero(f"{P}_session_rekeys", (segment,))
            if turn.rekey_of is None:
                return
            self._inc(ts, f"{P}_session_rekeys", (segment,))
            # A re-keyed conversation's turn is a follow-up of the session it continues: sticky
            # routing should have sent it back to that session's worker.
            continued = self.sessions.get(turn.rekey_of)
            prev = continued.worker if continued is not None else None
        self._inc(ts, f"{P}_followup_requests", ml)
        self._zero(f"{P}_sticky_collisions", ml)
        if prev is not None and prev != worker and not rec.get("migrated_from") and self.is_healthy(prev):
            self._inc(ts, f"{P}_sticky_collisions", ml)
        if cached is not None:
            self._inc(ts, f"{P}_session_followup_prompt_tokens", ml, prompt)
            self._inc(ts, f"{P}_session_followup_cached_tokens", ml, cached)
            turn.session.followup_prompt += prompt
            turn.session.followup_cached += cached
        # Reshuffle: sessions served before the last pool change and again after it.
        if self.pool_changes and turn.previous_epoch is not None and turn.previous_epoch < self.pool_epoch:
            change = self.pool_changes[-1]
            if self._reshuffle_counted.get(turn.session.key) != change.epoch:
                self._reshuffle_counted[turn.session.key] = change.epoch
                change.seen_both += 1
                change.moved += prev != worker
                if len(self._reshuffle_counted) > self.sessions.max_sessions:
                    self._reshuffle_counted.clear()

    def _migration(self, rec: dict, ts: float, worker: str) -> None:
        if "migrated_from" in rec:
            # A producer that reports migrations (even "none this time") gets both kinds at 0, so
            # the per-minute rates read 0 rather than "no data" until the first migration.
            for k in MIGRATION_KINDS:
                self._zero(f"{P}_session_migrations", (k,))
                if self.topology is not None:
                    self._zero(f"{P}_cross_node_migrations", (k,))
        src = rec.get("migrated_from")
        if not src:
            return
        kind = rec.get("migration_kind") or "hard"
        self._inc(ts, f"{P}_session_migrations", (kind,))
        a, b = self._topo(str(src)), self._topo(worker)
        if a is not None and b is not None:
            self._zero(f"{P}_cross_node_migrations", (kind,))
            if a.node != b.node:
                self._inc(ts, f"{P}_cross_node_migrations", (kind,))

    def _prefill(self, rec: dict, ts: float, worker: str, model: str, prompt: int, cached: int | None) -> None:
        prefill = rec.get("prefill_s")
        if prefill is None or cached is None:
            return
        prefill = float(prefill)
        cold = cached <= self.cold_reuse_share * prompt
        per_token = prefill / max(1, prompt - cached)
        path = "cold" if cold else "warm"
        self._observe(ts, f"{P}_prefill_seconds_per_token", (model, path), per_token)
        if not cold:
            return
        ml = (model,)
        wt = self._topo(worker)
        self._inc(ts, f"{P}_cold_requests", ml)
        self._observe(ts, f"{P}_cold_prefill_seconds", (model, wt.gpu_class if wt else UNKNOWN), prefill)
        gpu_s = prefill * (wt.gpus if wt else 1)
        self._inc(ts, f"{P}_cold_prefill_gpu_seconds", ml, gpu_s)
        if wt is not None:
            self._inc(ts, f"{P}_cold_prefill_cost_usd", ml, gpu_s * wt.price_per_gpu_hour / 3600.0)
        miss = prefill + float(rec.get("queue_s") or 0.0) + float(rec.get("migrate_s") or 0.0)
        self._observe(ts, f"{P}_prefix_miss_cost_seconds", ml, miss)

    # ---- reads (callers hold no lock; each takes it once) ------------------------------------
    def signals(self) -> dict[str, bool]:
        with self.lock:
            return self._signals()

    def _signals(self) -> dict[str, bool]:
        cutoff = self.now - self.window_s
        out = {name: False for name in catalog.SIGNALS}
        for signal, ts in self.field_seen.items():
            out[signal] = ts > cutoff
        out["kv_events"] = self.kv_seen
        out["worker_metrics"] = any(w.snapshot is not None for w in self.workers.values())
        out["spec_decode"] = self.spec_seen
        out["router_metrics"] = bool(self.routers)
        out["topology"] = self.topology is not None
        out["warm_pool"] = self.topology is not None and bool(self.topology.warm_pool)
        return out

    def tree_stats(self) -> TreeStats | None:
        """The latest completed statistics pass (None before the first one): never computes."""
        return self._tree_stats

    def refresh_tree_stats(self) -> TreeStats:
        """Run a statistics pass now if the index changed since the latest one; return the latest.

        Only the copy holds the state lock; the pass runs outside it and its result is swapped
        in whole, so readers see either the previous pass or this one.
        """
        with self._refresh_lock:  # a concurrent caller waits, then finds the statistics current
            with self.lock:
                latest = self._tree_stats
                if latest is not None and latest.version == self.index.version:
                    return latest
                t0 = time.perf_counter()
                tree = self.index.copy_for_stats()
                t1 = time.perf_counter()
            stats = compute_stats(tree, TREE_CHILDREN_DEPTH)
            self.tree_stats_timing = TreeStatsTiming(t1 - t0, time.perf_counter() - t1, stats.blocks)
            self._tree_stats = stats
            return stats

    def tree_stats_with_children(self, depth: int) -> TreeStats | None:
        """The latest statistics if they keep the runs ``depth`` edges deep, else a pass of
        their own for this one request (copied under the lock, computed outside it).
        None before the first pass: the tree is missing until the statistics exist."""
        latest = self._tree_stats
        if latest is None or latest.children_depth >= depth:
            return latest
        with self.lock:
            tree = self.index.copy_for_stats()
        return compute_stats(tree, depth)

    def worker_capacity(self, name: str) -> int | None:
        w = self.workers.get(name)
        if w is not None and w.snapshot is not None and w.snapshot.num_gpu_blocks:
            return w.snapshot.num_gpu_blocks
        t = self._topo(name)
        return t.kv_blocks if t is not None else None

    def worker_block_size(self, name: str) -> int:
        w = self.workers.get(name)
        if w is not None and w.block_size:
            return w.block_size
        return int(getattr(self.topology, "block_size", 0) or DEFAULT_BLOCK_SIZE)

    def warm_pool_utilization(self) -> dict[str, float]:
        """max(KV usage, running / max concurrency) per warm-pool worker with a scrape."""
        out: dict[str, float] = {}
        if self.topology is None:
            return out
        for name in self.topology.warm_pool:
            w = self.workers.get(name)
            snap = w.snapshot if w is not None else None
            if snap is None:
                continue
            parts = [snap.kv_usage_ratio] if snap.kv_usage_ratio is not None else []
            cap = snap.max_running or getattr(self._topo(name), "max_concurrency", None)
            if snap.running is not None and cap:
                parts.append(snap.running / cap)
            if parts:
                out[name] = max(parts)
        return out

    def worker_hit_ratio(self, name: str) -> float | None:
        """The worker's recent hit ratio: engine counters in the window, else its records."""
        q = self.win.get(("worker_delta", "prefix_queried_tokens", name))
        h = self.win.get(("worker_delta", "prefix_hit_tokens", name))
        if q:
            return (h or 0.0) / q
        p = self.win.get(("record_prompt", name))
        c = self.win.get(("record_cached", name))
        return (c or 0.0) / p if p else None

    def effective_cache_values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, blocks in self.index.resident_by_worker().items():
            ratio = self.worker_hit_ratio(name)
            if ratio is not None:
                out[name] = blocks * self.worker_block_size(name) * ratio
        return out

    @staticmethod
    def removal_ranks(values: dict[str, float]) -> dict[str, int]:
        """1 = safest to remove (least effective cache value; ties by name)."""
        order = sorted(values, key=lambda w: (values[w], w))
        return {w: i + 1 for i, w in enumerate(order)}

    def session_hit_ratios(self) -> list[float]:
        cutoff = self.now - self.window_s
        return [s.followup_cached / s.followup_prompt for s in self.sessions.sessions()
                if s.last_ts > cutoff and s.followup_prompt > 0]

    def branch_hits(self, start: float, end: float, stats: TreeStats | None = None) -> dict[int, tuple[float, set]]:
        """Hit tokens and sessions per branch for hits with start < ts ≤ end."""
        stats = stats or self._tree_stats or NO_TREE
        out: dict[int, tuple[float, set]] = {}
        for ts, chain, tokens, session in self.hit_events:
            if start < ts <= end:
                b = self.index.branch_of(chain, stats)
                if b is None:
                    continue
                tok, sess = out.get(b, (0.0, set()))
                if session:
                    sess.add(session)
                out[b] = (tok + tokens, sess)
        return out

    def hot_branches(self, k: int | None = None, stats: TreeStats | None = None) -> list[tuple[int, float, int]]:
        """Top-k branches of the window: (first block, hit tokens, sessions)."""
        k = self.top_k if k is None else k
        hits = self.branch_hits(self.now - self.window_s, self.now, stats)
        ranked = sorted(hits.items(), key=lambda kv: (-kv[1][0], kv[0]))[:k]
        return [(b, tok, len(sess)) for b, (tok, sess) in ranked]

    def fallback_active(self) -> dict[str, float]:
        cutoff = self.now - self.window_s
        return {tier: 1.0 if ts > cutoff else 0.0 for tier, ts in self.fallback_last.items()}

    def window_counter(self, metric: str, where: Callable[[LabelValues], bool] | None = None) -> float | None:
        """Σ over the window of a catalogue counter (all label sets, or those ``where`` accepts)."""
        vals = [v for key, v in self.win.sums.items()
                if key[0] == metric and len(key) == 2 and (where is None or where(key[1]))]
        return sum(vals) if vals else None

    def window_buckets(self, metric: str, window_s: float | None = None,
                       where: Callable[[LabelValues], bool] | None = None) -> tuple[tuple[float, ...], list[int]] | None:
        hw = self.long_hwin.get((metric, window_s)) if window_s and window_s != self.window_s else self.hwin.get(metric)
        if hw is None:
            return None
        out = [0] * (len(hw.bounds) + 1)
        for labels, row in hw.counts.items():
            if where is None or where(labels):
                for i, c in enumerate(row):
                    out[i] += c
        return hw.bounds, out

    def snapshot_for(self, fn: Callable[[ClusterState], Any]) -> Any:
        """Run a read under the lock (the collector and API builders use this)."""
        with self.lock:
            self._expire()
            return fn(self)

    def workers_seen(self) -> Iterable[str]:
        names = set(self.workers) | set(self.index.workers)
        return sorted(names)

    # ---- current series (the collector renders them; the checks read them) ---------------------
    def series(self) -> Series:
        """Every catalogue series as plain data, from the state and the exporter's Health."""
        out = Series()
        h_counters, h_gauges = self.health.snapshot()
        for name, s in self.cum.counters.items():
            out.counters[name] = dict(s)
        for name, s in h_counters.items():
            out.counters.setdefault(name, {}).update(s)
        for name, s in h_gauges.items():
            out.gauges[name] = dict(s)
        for name, s in self.cum.histograms.items():
            out.histograms[name] = {k: list(v) for k, v in s.items()}
        g = out.gauges
        if f"{P}_up" in h_gauges:
            self._track_down_targets()
            g[f"{P}_telemetry_blind_targets"] = {(): float(self.blind_targets())}
            # A worker that left the pool has no KV stream to keep fresh: its silence is the
            # fleet event step 2 reads, not a stale index, so its freshness series go away.
            for target, kind in self.down_since:
                if self._left_pool(target, kind):
                    for name in (f"{P}_kv_event_last_timestamp_seconds", f"{P}_kv_event_lag_seconds"):
                        g.get(name, {}).pop((target,), None)
        for w in self.workers_seen():
            info = self.workers.get(w)
            snap = info.snapshot if info else None
            if snap is not None and snap.kv_usage_ratio is not None:
                g.setdefault(f"{P}_worker_kv_cache_usage_ratio", {})[(w, snap.model or UNKNOWN)] = snap.kv_usage_ratio
            cap = self.worker_capacity(w)
            if cap is not None:
                g.setdefault(f"{P}_worker_capacity_blocks", {})[(w,)] = float(cap)
            if (info and info.block_size) or self.topology is not None:
                g.setdefault(f"{P}_worker_block_size_tokens", {})[(w,)] = float(self.worker_block_size(w))
        if self.topology is not None:
            g[f"{P}_worker_info"] = {
                (t.name, t.node, t.nvlink_domain, t.gpu_class, "true" if t.warm_pool else "false"): 1.0
                for t in (self.topology.worker(w) for w in self.workers_seen() if w in self.topology)}
        for w, n in self.index.resident_by_worker().items():
            g.setdefault(f"{P}_worker_resident_blocks", {})[(w,)] = float(n)
        for w, u in self.warm_pool_utilization().items():
            g.setdefault(f"{P}_warm_pool_utilization_ratio", {})[(w,)] = u
        values = self.effective_cache_values()
        ranks = self.removal_ranks(values)
        g[f"{P}_worker_effective_cache_value_tokens"] = {(w,): v for w, v in values.items()}
        g[f"{P}_worker_removal_rank"] = {(w,): float(r) for w, r in ranks.items()}
        stats = self._tree_stats  # the latest background pass; None (missing) before the first
        if stats is not None:
            g[f"{P}_prefix_tree_root_fanout"] = {(): float(stats.root_fanout)}
            g[f"{P}_prefix_tree_nodes"] = {(): float(stats.nodes)}
            g[f"{P}_prefix_tree_blocks"] = {(): float(stats.blocks)}
        g[f"{P}_worker_pool_size"] = {(): float(len(self.pool))}
        out.counters.setdefault(f"{P}_worker_pool_changes", {}).setdefault((), 0.0)
        if self.pool_changes and self.pool_changes[-1].reshuffled_share is not None:
            g[f"{P}_session_reshuffle_ratio"] = {(): self.pool_changes[-1].reshuffled_share}
        g[f"{P}_fallback_active"] = {(t,): v for t, v in self.fallback_active().items()}
        g[f"{P}_hot_branch_hit_tokens"] = {(str(i + 1), branch_label(b)): tok
                                         for i, (b, tok, _s) in enumerate(self.hot_branches(stats=stats))}
        for snap in self.routers.values():
            for w, v in snap.decisions.items():
                out.counters.setdefault(f"{P}_router_decisions", {})[(snap.router, w)] = v
            for o, v in snap.prefix_outcomes.items():
                out.counters.setdefault(f"{P}_router_prefix_outcomes", {})[(snap.router, o)] = v
            for w, v in snap.healthy.items():
                g.setdefault(f"{P}_router_worker_healthy", {})[(snap.router, w)] = v
        signals = self._signals()
        g[f"{P}_signal_available"] = {(s,): 1.0 if v else 0.0 for s, v in signals.items()}
        g[f"{P}_exporter_build_info"] = {(__version__,): 1.0}
        gh = out.gaugehistograms
        gh[f"{P}_session_hit_ratio"] = self.session_hit_ratios()
        if stats is not None:
            gh[f"{P}_prefix_tree_leaf_depth"] = stats.leaf_depths
            gh[f"{P}_prefix_tree_leaf_block_depth"] = stats.leaf_block_depths
            gh[f"{P}_prefix_tree_node_fanout"] = stats.fanouts
            gh[f"{P}_prefix_tree_block_replicas"] = stats.replicas
        out.signals = signals
        return out


@dataclass
class Series:
    """Current values: counters and gauges per label values, histogram rows
    ([per-bucket counts..., +Inf, sum]) and gauge-histogram observations (values or value counts)."""

    counters: dict[str, dict[LabelValues, float]] = field(default_factory=dict)
    gauges: dict[str, dict[LabelValues, float]] = field(default_factory=dict)
    histograms: dict[str, dict[LabelValues, list[float]]] = field(default_factory=dict)
    gaugehistograms: dict[str, Any] = field(default_factory=dict)
    signals: dict[str, bool] = field(default_factory=dict)
