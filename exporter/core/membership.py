"""Workers that service discovery (or a config reload) adds and drops, applied to the state's parts.

A dropped worker's cache went with it: its view leaves the index at once, it leaves the pool at
once (a pool change, as any departure), and its gauges (up, KV freshness) go at once, so no check
reads a gone worker as down, stale or blind. Its counters stay until ``label_idle`` (as for a
worker records stop naming), then :meth:`Membership.retire` forgets the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from exporter.core.cardinality import RecordLabels
from exporter.core.health import Health
from exporter.core.input_time import InputTime
from exporter.core.kv_accounting import KvAccounting
from exporter.core.metric_store import MetricStore
from exporter.core.worker_pool import WorkerPool


class Membership:
    def __init__(self, pool: WorkerPool, kv: KvAccounting, store: MetricStore, health: Health,
                 labels: RecordLabels, time: InputTime, lock: threading.Lock,
                 pool_changed: Callable[[float], None]) -> None:
        """``pool_changed``: the state's own pool update (it counts a change of the pool)."""
        self.pool, self.kv, self.store, self.health, self.labels = pool, kv, store, health, labels
        self.time, self.lock, self._pool_changed = time, lock, pool_changed

    def left(self, names: Iterable[str]) -> None:
        """Workers discovery (or a reload) dropped."""
        names = list(names)
        if not names:
            return
        with self.lock:
            ts = self.time.now
            for name in names:
                self.pool.depart(name, ts)
                self.kv.worker_left(name)
            self._pool_changed(ts)
        for name in names:
            self.health.drop_worker(name, counters=False)

    def joined(self, names: Iterable[str], announced: bool = True) -> None:
        """Workers discovery (or a reload) added: they keep their own series (never folded into
        ``other``); one that had left is a worker again. ``announced`` (not for the fleet found at
        start): its entering the pool is a pool change."""
        names = list(names)
        with self.lock:
            for name in names:
                self.pool.rejoin(name, announced)
            self.labels.pin_workers(names)

    def retire(self, now: float) -> None:
        """Forget departed workers gone for ``label_idle``: their series and their entry (under the lock)."""
        pool, labels = self.pool, self.labels
        for name, left_at in list(pool.departed.items()):
            if now - left_at < labels.worker.idle_s:
                continue
            pool.retire(name)
            self.store.drop_label_value("worker", name)
            self.health.drop_worker(name)
            labels.worker.pinned = labels.worker.pinned - {name}
            self.kv.worker_retired(name)
