"""What one KV-event batch does: the worker's view in the prefix index, evictions, prefix
instability, placements, attribution of resident blocks, and the stream's health series — and
whether the view is still true (unhealed loss, drift, repair).

A batch is applied in one shape whatever its form: the compiled reader's arrays (a scanned batch,
applied without event objects) or plain events go through the same steps — index, attribution,
evictions, root branches, block size — each asked of the batch's form (:class:`_Scanned`,
:class:`_Events`).

The parts are handed in (the index, the eviction and root trackers, the worker pool, the metric
store, the state's lock), as for ``exporter.core.record_accounting``. :meth:`KvAccounting.apply`
runs under the caller's lock (the state brings the pool and the windows up to date in the same
hold); :meth:`KvAccounting.settle` then writes the batch's health series in one call and starts a
repair outside it. The view's other events (restart, rebuild, repair) take the lock themselves.

KV-event stream health split: sources count what they see on the wire (sequence gaps, missed
batches, replays, decode errors); this counts what applying the events did (batches, events
applied, unknown parents and removals, restarts, last batch time and lag).
"""

from __future__ import annotations

import threading
from typing import Any

from exporter.core.attribution import KvAttribution
from exporter.core.health import Health, LabelValues
from exporter.core.index.eviction import BatchEvictions
from exporter.core.index.prefix_index import EvictionTracker, PrefixIndex
from exporter.core.index.prefix_instability import (
    COMPARED_BLOCKS,
    EARLY_SPAN_BLOCKS,
    MIN_SHARED_BLOCKS,
    ROOT_KEYS,
    RootBatch,
    RootTracker,
)
from exporter.core.index.tiers import GPU
from exporter.core.input_time import InputTime
from exporter.core.metric_store import MetricStore
from exporter.core.record_accounting import UNKNOWN
from exporter.core.worker_pool import WorkerInfo, WorkerPool
from exporter.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    RebuildRequest,
    new_root_event,
    unlabelled_events,
)
from prefixscope import catalog
from prefixscope.topology import Topology

P = catalog.NAMESPACE


def _m(name: str) -> str:
    return catalog.METRICS_BY_NAME[f"{P}_{name}"].name


# Series every KV batch updates, looked up in the catalogue once (a missing one fails at import).
KV_BATCHES = _m("kv_event_batches")
KV_APPLIED = _m("kv_events_applied")
KV_UNKNOWN_PARENT = _m("kv_event_unknown_parent")
KV_UNKNOWN_REMOVALS = _m("kv_event_unknown_block_removals")
KV_MISSED = _m("kv_event_missed_batches")
KV_LOST = _m("kv_event_lost_batches")
KV_REPAIRS = _m("kv_index_repairs")
KV_UNRELIABLE = _m("kv_view_unreliable")
KV_LAST_TS = _m("kv_event_last_timestamp_seconds")
KV_LAG = _m("kv_event_lag_seconds")
WORKER_RESTARTS = _m("worker_restarts")
_BLOCKS_STORED = _m("kv_blocks_stored")
_BLOCKS_EVICTED = _m("kv_blocks_evicted")
_BLOCKS_RESTORED = _m("kv_blocks_restored_after_eviction")
_EVICTION_AGE = _m("kv_block_eviction_age_seconds")
_ROOT_BRANCHES = _m("prefix_root_branches")
_UNSTABLE_ROOTS = _m("prefix_unstable_root_branches")
_KV_PLACEMENTS = _m("kv_placement_decisions")
_KV_PLACEMENT_HITS = _m("kv_placement_domain_hits")
_STORED, _REMOVED, _CLEARED = BlockStored.__name__, BlockRemoved.__name__, AllBlocksCleared.__name__  # event label

# Why a worker's view was repaired (the reason label of prefixscope_kv_index_repairs_total).
LOST_BATCHES = "lost_batches"  # batches lost on the wire that no replay recovered
OVER_CAPACITY = "over_capacity"  # the view holds more GPU blocks than the worker has: provably wrong
REPAIR_REASONS = (LOST_BATCHES, OVER_CAPACITY)

Incs = list[tuple[str, LabelValues, float]]
# Every series :meth:`KvAccounting.settle` writes, with its label count (``Health.check``'s test).
_SETTLE_SERIES = ((KV_BATCHES, ("",)), (KV_APPLIED, ("", "")), (KV_UNKNOWN_PARENT, ("",)),
                  (KV_UNKNOWN_REMOVALS, ("",)), (KV_MISSED, ("",)), (KV_LOST, ("",)), (KV_REPAIRS, ("", "")),
                  (KV_UNRELIABLE, ("",)), (KV_LAST_TS, ("",)), (KV_LAG, ("",)), (WORKER_RESTARTS, ("",)))


class _KvLabels:
    """One worker's label tuples for its per-batch series, built once instead of per batch."""

    __slots__ = ("applied_cleared", "applied_removed", "applied_stored", "batches", "evicted", "lab", "restored",
                 "reused_false", "reused_true", "stored")

    def __init__(self, worker: str) -> None:
        self.lab = (worker,)
        # the eviction counters' store keys, built once: the store's dicts find them by identity
        self.stored, self.restored = (_BLOCKS_STORED, self.lab), (_BLOCKS_RESTORED, self.lab)
        self.evicted = (_BLOCKS_EVICTED, self.lab)
        self.batches = (KV_BATCHES, self.lab, 1.0)
        self.applied_stored = (worker, _STORED)
        self.applied_removed = (worker, _REMOVED)
        self.applied_cleared = (worker, _CLEARED)
        self.reused_true = (worker, "true")
        self.reused_false = (worker, "false")


def _split_ages(ages: list[tuple[float, bool]]) -> tuple[bool, list[float], list[float]]:
    """(first observation reused, reused ages, fresh ages), each in order (``_prefix_core.split_ages``
    does the same in C)."""
    return (bool(ages) and bool(ages[0][1]), [age for age, r in ages if r is True],
            [age for age, r in ages if r is False])


try:
    from exporter.core.index._prefix_core import split_ages
except ImportError:  # no compiled core in this install
    split_ages = _split_ages


def reference_evictions(store: MetricStore, kl: _KvLabels, ts: float, ev: BatchEvictions, age_metric: str) -> None:
    """The eviction series of a batch without root branches or placements (the common one): its
    counters in one keyed write, then its sampled ages, each label's in event order, the label
    seen first first (as one observation at a time would). ``exporter.core._kv_batch_core`` does
    the same in C."""
    stored, evicted, ages = ev.stored, ev.evicted, ev.ages
    if not (stored or evicted or ages):
        return
    if stored:
        store.inc_keyed(ts, ((kl.stored, stored), (kl.restored, ev.restored), (kl.evicted, evicted))
                        if evicted else ((kl.stored, stored), (kl.restored, ev.restored)))
    elif evicted:
        store.inc_keyed(ts, ((kl.evicted, evicted),))
    if ages:
        observe_ages(store, kl, ts, ages, age_metric)


def observe_ages(store: MetricStore, kl: _KvLabels, ts: float, ages: list[tuple[float, bool]],
                 age_metric: str = _EVICTION_AGE) -> None:
    """A batch's sampled eviction ages, each label's in event order, the label seen first first:
    as one observation at a time would."""
    reused_first, reused, fresh = split_ages(ages)
    if reused_first:
        store.observe_many(ts, age_metric, kl.reused_true, reused)
        if fresh:
            store.observe_many(ts, age_metric, kl.reused_false, fresh)
    else:
        store.observe_many(ts, age_metric, kl.reused_false, fresh)
        if reused:
            store.observe_many(ts, age_metric, kl.reused_true, reused)


def reference_stream_batch(health: Health, kl: _KvLabels, received_at: float, lag: float, stored_events: int,
                           removed_events: int, applied: str, last_ts: str, lag_metric: str) -> None:
    """A worker's stream-health writes for a batch after its first that needs no other (no unknown
    parent or removal, no cache reset, its view not newly reliable): one :meth:`Health.update`.
    ``exporter.core._kv_batch_core`` does the same in C, without building the lists."""
    incs: Incs = [kl.batches]
    if stored_events:
        incs.append((applied, kl.applied_stored, stored_events))
    if removed_events:
        incs.append((applied, kl.applied_removed, removed_events))
    health.update(incs, [(last_ts, kl.lab, received_at), (lag_metric, kl.lab, lag)], checked=True)


try:
    from exporter.core._kv_batch_core import count_evictions as _common_evictions
    from exporter.core._kv_batch_core import stream_batch as _stream_batch
except ImportError:  # no compiled core in this install
    _common_evictions = reference_evictions
    _stream_batch = reference_stream_batch


# ---- a batch's form: each step of applying it, asked of the form ---------------------------------
class _Events:
    """A batch of plain event objects."""

    __slots__ = ("batch",)

    def __init__(self, batch: KvBatch) -> None:
        self.batch = batch

    def index(self, index: PrefixIndex, worker: str) -> Any:
        return index.apply(worker, self.batch.events)

    def attribute(self, attribution: KvAttribution, worker: str) -> None:
        if self.batch.label_events is not None:
            attribution.apply(worker, self.batch.label_events)

    def evictions(self, evictions: EvictionTracker, worker: str, ts: float) -> BatchEvictions:
        return evictions.apply(worker, self.batch.events, ts)

    def roots(self, roots: RootTracker, worker: str, ts: float) -> RootBatch | None:
        return roots.apply(worker, self.batch.events, ts)

    def block_size(self) -> int | None:
        return next((ev.block_size for ev in self.batch.events if isinstance(ev, BlockStored) and ev.block_size), None)


class _Scanned(_Events):
    """A batch the compiled reader scanned: applied from its arrays, without event objects."""

    __slots__ = ("scan",)

    def __init__(self, batch: KvBatch, scan: Any) -> None:
        self.batch, self.scan = batch, scan

    def index(self, index: PrefixIndex, worker: str) -> Any:
        return index.apply_scan(worker, self.scan)

    def attribute(self, attribution: KvAttribution, worker: str) -> None:
        if self.batch.attributed:  # type: ignore[attr-defined]  # (a labelled batch never comes scanned then)
            if attribution.holds_labels(worker):
                attribution.apply_unlabelled(worker, unlabelled_events(self.batch))
            else:
                attribution.note_batch()

    def evictions(self, evictions: EvictionTracker, worker: str, ts: float) -> BatchEvictions:
        return evictions.apply_scan(worker, self.scan, ts)

    def roots(self, roots: RootTracker, worker: str, ts: float) -> RootBatch | None:
        scan = self.scan
        if not scan.roots:  # prefix instability reads root stores only
            return None
        if type(roots) is RootTracker and ROOT_KEYS:  # their keys computed from the payload in C
            return roots.apply_keyed(worker, scan.root_keys(COMPARED_BLOCKS, EARLY_SPAN_BLOCKS, MIN_SHARED_BLOCKS), ts)
        # (a shard's shared tracker is fed the events by its sink)
        return roots.apply(worker, scan.root_events(new_root_event, COMPARED_BLOCKS), ts)

    def block_size(self) -> int | None:
        return self.scan.block_size


# What :meth:`KvAccounting.apply` leaves for :meth:`KvAccounting.settle` (outside the lock), a plain
# tuple (one per KV batch): the batch, its receive time, the index's apply result (counts of what the
# events did), whether it is the worker's first batch (its stream series start at 0), whether its
# view became reliable again, and a reason to repair the view now (or None).
Applied = tuple[KvBatch, float, Any, bool, bool, str | None]


class KvAccounting:
    """Applies KV-event batches to the prefix index, the eviction and root trackers, attribution and
    the metric store, and keeps each worker's view true."""

    def __init__(self, time: InputTime, store: MetricStore, pool: WorkerPool, index: PrefixIndex,
                 evictions: EvictionTracker, roots: RootTracker, attribution: KvAttribution, health: Health,
                 lock: threading.Lock, *, topology: Topology | None = None, window_s: float = 300.0,
                 rebuild_request: RebuildRequest | None = None) -> None:
        """``roots``: the state's root tracker (a shard's ``SharedRoots`` is fed every root by its
        sink); ``window_s``: a repaired view is not checked again within it; ``rebuild_request``:
        the KV source's, None where no source can rebuild a view (it is then marked unreliable)."""
        self.time = time
        self.store = store
        self.pool = pool
        self.index = index
        self.evictions = evictions
        self.roots = roots
        self.attribution = attribution
        self.health = health
        self.lock = lock
        self.topology = topology
        self.window_s = float(window_s)
        self.rebuild_request = rebuild_request
        self.seen = False  # a KV batch arrived
        self._workers: set[str] = set()  # workers whose KV health series exist
        self._labels: dict[str, _KvLabels] = {}  # a worker's label tuples, built once (per-batch series)
        # Views that may be wrong (until a complete rebuild, a cache reset or a restart): worker ->
        # GPU blocks stored since it was marked (which alone never clears the mark: _turnover).
        self._unreliable: dict[str, int] = {}
        self._rebuilding: set[str] = set()  # workers whose rebuild the KV source is running
        # worker -> input time of its last repair: drift is not checked again within a window (a
        # complete rebuild that still shows the drift means the stream itself says so: no loop)
        self._repaired_at: dict[str, float] = {}
        self._other_media: set[str] = set()  # workers that sent CPU/disk events (the index counts every medium)
        # Batches the compiled reader scanned are applied from its arrays when both parts are compiled,
        # the index and the eviction tracker in one pass of one call (``apply_kv``) when both are the core's.
        self._applies_scans = hasattr(index, "apply_scan") and hasattr(evictions, "apply_scan")
        self._one_pass = self._applies_scans and hasattr(index, "apply_kv") and type(evictions) is EvictionTracker
        # Placement judged from KV events (exporter.core.index.prefix_index_ref's docstring), only with a topology.
        self._placement_out: frozenset[str] = frozenset()  # workers that left the pool, as the index has them
        if topology is not None:
            self.set_topology(topology)
        for metric, labels in _SETTLE_SERIES:  # validated once here, so no batch's write checks them again
            health.check(metric, labels)

    def set_topology(self, topology: Topology | None) -> None:
        """Judge placement from the GPU stores by ``topology`` from now on; None: stop (the caller
        holds the state lock)."""
        self.topology = topology
        self.index.set_placement_domains({w.name: w.nvlink_domain for w in topology.workers}
                                         if topology is not None else None)

    def labels(self, worker: str) -> _KvLabels:
        kl = self._labels.get(worker)
        if kl is None:
            kl = self._labels[worker] = _KvLabels(worker)
        return kl

    # ---- one batch -----------------------------------------------------------------------------
    def apply(self, batch: KvBatch, received_at: float) -> Applied:
        """Apply the batch's events (the caller holds the lock); hand the result to :meth:`settle`."""
        worker = batch.worker
        self.seen = True
        w = self.pool.worker(worker, received_at)
        cap = self.pool.worker_capacity(worker, w)
        self.evictions.size_for(worker, cap)  # thrash reaches past its cache
        if self.topology is not None:
            self._placement_pool()
            self.index.set_placement_clock(batch.ts)
        scan = batch.scan
        if scan is not None and self._one_pass:  # the common batch: one call into C, no form object
            res, ev = self.index.apply_kv(worker, scan, self.evictions, received_at)
            if batch.attributed:  # type: ignore[attr-defined]
                _Scanned(batch, scan).attribute(self.attribution, worker)
            got = _Scanned(batch, scan).roots(self.roots, worker, received_at) if scan.roots else None
            if not w.block_size:
                w.block_size = scan.block_size
        else:
            form = _Scanned(batch, scan) if self._applies_scans and scan is not None else _Events(batch)
            res = form.index(self.index, worker)
            form.attribute(self.attribution, worker)
            ev = form.evictions(self.evictions, worker, received_at)
            got = form.roots(self.roots, worker, received_at)
            if not w.block_size:
                w.block_size = form.block_size()
        self.count_evictions(worker, ev, received_at, got,
                             self._placement_incs(w, res.placements, res.placement_hits) if res.placements else None)
        if worker in self._workers:
            first = False
        else:
            first = True
            self._workers.add(worker)
        reliable_again = worker in self._unreliable and self._turnover(worker, ev.stored, res.cleared > 0)
        return batch, received_at, res, first, reliable_again, self._drift(worker, w, cap)

    def settle(self, applied: Applied, stream: bool = True) -> None:
        """The batch's health series in one Health call (one lock round trip), then a repair if the
        view drifted. ``stream`` False (a family shard that is not the worker's home): the worker's
        stream-health series (batches, lag, last timestamp) are left to its home shard."""
        batch, received_at, res, first, reliable_again, drift = applied
        kl = self._labels.get(batch.worker)
        if kl is None:
            kl = self.labels(batch.worker)
        if stream and not (first or reliable_again or res.unknown_parent or res.unknown_removals or res.cleared):
            lag = received_at - batch.ts  # the common batch: the writes below, without their lists
            _stream_batch(self.health, kl, received_at, lag if lag > 0.0 else 0.0, res.stored_events,
                          res.removed_events, KV_APPLIED, KV_LAST_TS, KV_LAG)
            if drift is not None:
                self.repair(batch.worker, drift)
            return
        lab = kl.lab
        if stream:
            incs: Incs = [kl.batches]
            lag = received_at - batch.ts
            sets: Incs = [(KV_LAST_TS, lab, received_at), (KV_LAG, lab, lag if lag > 0.0 else 0.0)]
            if first:  # these exist from a worker's first batch: a stream with no gap reads 0, not missing
                incs += [(WORKER_RESTARTS, lab, 0), (KV_MISSED, lab, 0), (KV_LOST, lab, 0),
                         (KV_UNKNOWN_PARENT, lab, 0), (KV_UNKNOWN_REMOVALS, lab, 0),
                         *((KV_REPAIRS, (batch.worker, r), 0) for r in REPAIR_REASONS)]
                sets.append((KV_UNRELIABLE, lab, 0.0))
        else:
            incs, sets = [], []
        if reliable_again:
            sets.append((KV_UNRELIABLE, lab, 0.0))
        # (each count tested in turn, no tuple of them built: this runs once per KV batch)
        if n := res.unknown_parent:
            incs.append((KV_UNKNOWN_PARENT, lab, n))
        if n := res.unknown_removals:
            incs.append((KV_UNKNOWN_REMOVALS, lab, n))
        if n := res.stored_events:
            incs.append((KV_APPLIED, kl.applied_stored, n))
        if n := res.removed_events:
            incs.append((KV_APPLIED, kl.applied_removed, n))
        if n := res.cleared:
            incs.append((KV_APPLIED, kl.applied_cleared, n))
        self.health.update(incs, sets, checked=True)  # (its series checked in __init__)
        if drift is not None:
            self.repair(batch.worker, drift)

    def _placement_pool(self) -> None:
        """Tell the index which workers left the pool: their blocks are no placement's prefix, as
        for records (``RecordAccounting._prefix``). Usually the same set as before: one identity test."""
        out = self.pool.left_workers()  # kept by the pool between changes: usually the same set
        if out is not self._placement_out:
            if out != self._placement_out:
                self.index.set_placement_excluded(out)
            self._placement_out = out

    def _placement_incs(self, w: WorkerInfo, placements: int, hits: int) -> Incs:
        """A batch's placements judged from its GPU stores, under the worker's model (its scrape's,
        else the topology's)."""
        snap = w.snapshot
        model = (snap.model if snap is not None else None) or getattr(self.topology, "model", None) or UNKNOWN
        lab = (model,)  # (the hits series exists with the decisions: a ratio's numerator reads 0, not missing)
        return [(_KV_PLACEMENTS, lab, placements), (_KV_PLACEMENT_HITS, lab, hits)]

    def count_evictions(self, worker: str, ev: BatchEvictions, ts: float, roots: RootBatch | None = None,
                        more: Incs | None = None) -> None:
        """The eviction and prefix-instability series of one batch (under the lock), the counters in
        one write with the batch's ``more`` (its placements). Both instability counters exist from
        the first judgeable root on, so a fleet without unstable prefixes reads 0; thrash (restored)
        exists wherever stores do."""
        if ev.other_media:
            self._other_media.add(worker)
        if roots is None and not more:  # the common batch: its counters in one keyed write
            kl = self._labels.get(worker)
            _common_evictions(self.store, kl if kl is not None else self.labels(worker), ts, ev, _EVICTION_AGE)
            return
        stored, evicted, ages = ev.stored, ev.evicted, ev.ages
        if roots is not None and roots.roots:
            incs: Incs = [(_ROOT_BRANCHES, (), roots.roots), (_UNSTABLE_ROOTS, (), roots.unstable)]
        elif not (stored or evicted or ages or more):
            return
        else:
            incs = []
        if more:
            incs += more
        kl = self.labels(worker)
        lab = kl.lab
        store = self.store
        if stored:
            incs += [(_BLOCKS_STORED, lab, stored), (_BLOCKS_RESTORED, lab, ev.restored)]
        if evicted:
            incs.append((_BLOCKS_EVICTED, lab, evicted))
        if incs:
            store.inc_many(ts, incs)
        if ages:
            observe_ages(store, kl, ts, ages)

    # ---- view truth: unhealed loss, drift, repair ---------------------------------------------
    def _turnover(self, worker: str, stored: int, cleared: bool) -> bool:
        """True when an unreliable view became exact again: the worker reset its cache.

        A view marked unreliable may miss blocks the lost batches stored and hold blocks they
        removed. No number of later stores confirms it: a hot block, hit all along and never
        announced again, outlives any turnover, so counting stores would clear the mark while
        such blocks are still missing. Only what empties the worker's cache (an
        ``AllBlocksCleared``, or a restart) or a complete rebuild (:meth:`view_repaired`) makes
        the view known exactly.
        """
        since = self._unreliable.get(worker)
        if since is None:
            return False
        if cleared:
            del self._unreliable[worker]
            return True
        self._unreliable[worker] = since + stored
        return False

    def _drift(self, worker: str, w: WorkerInfo | None = None, cap: int | bool | None = False) -> str | None:
        """A reason to repair the worker's view now, or None (under the lock).

        The only sound check against the worker's own report is an impossible count: more GPU
        blocks resident than ``num_gpu_blocks``. ``kv_cache_usage_perc`` is no bound either way
        (it counts blocks allocated to running requests, cached or not, and counts cached blocks
        nobody references as free: vllm.md §1.4), so it is not compared. Workers that send other
        media (CPU, disk) are skipped: the index counts their blocks together.
        """
        if worker in self._unreliable or worker in self._rebuilding or worker in self._other_media:
            return None
        last = self._repaired_at.get(worker)
        if last is not None and self.time.now - last < self.window_s:
            return None
        if cap is False:  # (else the caller's reading of it, this batch)
            cap = self.pool.worker_capacity(worker, w)
        if not cap:  # no bound known: nothing to compare (the resident count is not read)
            return None
        resident = self.index.resident_blocks(worker, GPU)  # the GPU's blocks against the GPU's capacity
        if resident is not None and resident > cap:
            return OVER_CAPACITY
        return None

    def drift_after_scrape(self, worker: str) -> str | None:
        """A scrape's new capacity may show a drifted view (under the lock): a reason to repair it."""
        return self._drift(worker) if worker in self._workers else None

    def repair(self, worker: str, reason: str) -> None:
        """Repair a drifted view (outside the lock): it is provably wrong, so it is cleared; the KV
        source rebuilds it from the worker's replay, or, if it cannot, it stays unreliable."""
        with self.lock:
            if worker in self._rebuilding:
                return
            self._rebuilding.add(worker)
        request = self.rebuild_request
        if request is None or not request(worker, reason):
            self.reset_view(worker)
            self.view_repaired(worker, reason, reliable=False)

    def _clear(self, worker: str) -> None:
        self.index.clear_worker(worker)
        self.evictions.clear_worker(worker)
        self.attribution.clear_worker(worker)

    def reset_view(self, worker: str) -> None:
        """Forget the worker's view before a rebuild (not a restart: nothing is counted)."""
        with self.lock:
            self._clear(worker)
            self._rebuilding.add(worker)

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """Count one repair; ``reliable`` False leaves the view marked until a complete rebuild, a
        cache reset or a restart."""
        with self.lock:
            self._rebuilding.discard(worker)
            self._repaired_at[worker] = self.time.now
            if reliable:
                self._unreliable.pop(worker, None)
            else:
                self._unreliable[worker] = 0
        self.health.update([(KV_REPAIRS, (worker, reason), 1.0)],
                           [(KV_UNRELIABLE, (worker,), 0.0 if reliable else 1.0)])

    def unreliable_views(self) -> list[str]:
        with self.lock:
            return sorted(self._unreliable)

    def worker_left(self, worker: str) -> None:
        """A worker discovery dropped (the caller holds the lock): its cache went with it, so its
        view leaves the index and no mark, rebuild or health series of its KV stream stays."""
        self._clear(worker)
        self._unreliable.pop(worker, None)
        self._rebuilding.discard(worker)
        self._workers.discard(worker)

    def worker_retired(self, worker: str) -> None:
        """A departed worker gone for ``label_idle`` (under the lock): its last entries go too."""
        self._labels.pop(worker, None)
        self._repaired_at.pop(worker, None)

    def worker_restarted(self, worker: str, stream: bool = True) -> None:
        """``stream`` False: clear the view without counting the restart (counted by the home shard)."""
        with self.lock:
            self._clear(worker)
            was_unreliable = self._unreliable.pop(worker, None) is not None  # an empty cache is known exactly
        if stream:
            self.health.inc(WORKER_RESTARTS, (worker,))
        if was_unreliable:
            self.health.set(KV_UNRELIABLE, (worker,), 0.0)
