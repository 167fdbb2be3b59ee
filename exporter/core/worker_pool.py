"""The workers the exporter knows, which of them are healthy (the pool), and how the pool changed.

A worker is healthy when it was seen alive recently (a record it served, a scrape, a KV batch)
and neither a scrape target's ``up`` nor a router's health gauge says it is down. The pool is
the healthy set; once the exporter has finished discovering its workers (one health-recency
span after its first input), every change of that set is a pool change, counted and kept so
the session table can measure how many sessions it reshuffled.

A worker whose scrapes fail is either blinding us (traffic still reaches it) or has left the
pool (its traffic stopped when it went down): :meth:`WorkerPool.left_pool` tells them apart.
Two things settle it whatever the traffic sources say: a worker that service discovery (or a
reload) dropped has departed (:meth:`WorkerPool.depart`: out of the pool at once, never blind),
and a worker target down for ``down_grace_s`` has left — without a traffic source (a minimal
deployment), a scaled-away worker would otherwise count as blind for ever.
:meth:`WorkerPool.liveness` puts each worker in one of three states — up, down, left — the
states the console's Workers page shows.

Nothing here walks the workers per input. Which targets are down is kept as the up gauges and
the routers' health change (:meth:`Health.follow` hands the pool the series written since it last
looked), which down workers left the pool is kept until something it depends on changes, and
:meth:`WorkerPool.note` judges only the workers whose evidence or down state changed; the full
:meth:`WorkerPool.update` runs when a member can have aged out (about once per health recency),
on a router's scrape and when discovery drops workers.

Not thread-safe on its own: ``ClusterState`` calls it under its lock (:meth:`WorkerPool.is_healthy`
only reads, and may be called without it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from exporter.core.health import Health
from exporter.core.input_time import InputTime
from exporter.model import RouterSnapshot, WorkerSnapshot
from prefixscope import catalog
from prefixscope.topology import Topology, WorkerTopo

UP = f"{catalog.NAMESPACE}_up"
DEFAULT_BLOCK_SIZE = 16  # vLLM's default, used only when neither the record nor the worker says
Liveness = Literal["up", "down", "left"]
MAX_POOL_CHANGES = 100


@dataclass
class WorkerInfo:
    name: str
    last_seen: float = 0.0  # newest evidence of life: record served, scrape, KV batch
    last_served: float = 0.0  # newest evidence of traffic: a record, or a router decision count rising
    snapshot: WorkerSnapshot | None = None
    scraped_at: float | None = None
    block_size: int | None = None
    last_counters: dict[str, float] = field(default_factory=dict)
    # (metric, labels) of each series its scrapes reported -> the newest scrape that did
    reported: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    # (the KV freshness stamp, the prefix-cache query count at the first scrape after it): a worker
    # is idle only while it has answered no query since then (exporter.core.state.observe_worker)
    quiet_mark: tuple[float, float] | None = None


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


class WorkerPool:
    """Known workers and routers, the healthy set, and its changes."""

    def __init__(self, health: Health, time: InputTime, health_recency_s: float,
                 topology: Topology | None = None, down_grace_s: float = math.inf) -> None:
        self.health = health
        self._down_grace_s = down_grace_s  # a worker target down this long has left (never blind)
        self.departed: dict[str, float] = {}  # workers discovery dropped -> input time they left
        # Workers whose coming or going service discovery announced: their entering or leaving the
        # pool is a change even while the exporter is still finding its workers by evidence.
        self.announced: set[str] = set()
        self.time = time
        self.health_recency_s = health_recency_s
        self.topology = topology  # what a worker is when its scrape does not say (capacity, block size)
        self.workers: dict[str, WorkerInfo] = {}
        self.routers: dict[str, RouterSnapshot] = {}
        self.down_since: dict[tuple[str, ...], float] = {}  # (target, kind) -> first failing observation
        self.pool: frozenset[str] = frozenset()
        self.epoch = 0
        self.changes: deque[PoolChange] = deque(maxlen=MAX_POOL_CHANGES)
        self._records_seen = False  # a record source exists: it tells which workers serve traffic
        self._stable_until = -math.inf  # input time until which no pool member can age out
        # Explicitly down, kept on change: the up series written since the pool last looked, the
        # targets' up series at 0, each router's unhealthy workers, and per name how many of
        # those say it is down.
        self._up_changes = health.follow(UP)
        self._zero: set[tuple[str, ...]] = set()
        self._router_down: dict[str, frozenset[str]] = {}
        self._down_refs: dict[str, int] = {}
        self._pending: set[str] = set()  # names whose down state changed since the pool was judged
        # The worker targets that left the pool (``left_pool``), kept until something they depend
        # on changes (None: to be found again) or a down worker's grace runs out.
        self._left: list[tuple[str, ...]] | None = None
        self._left_workers: frozenset[str] = frozenset()
        self._left_until = math.inf

    @property
    def records_seen(self) -> bool:
        return self._records_seen

    @records_seen.setter
    def records_seen(self, seen: bool) -> None:
        if seen != self._records_seen:
            self._records_seen = seen
            self._left = None

    @property
    def down_grace_s(self) -> float:
        return self._down_grace_s

    @down_grace_s.setter
    def down_grace_s(self, grace: float) -> None:
        self._down_grace_s = grace
        self._left = None

    def model_of(self, name: str) -> str | None:
        """The model the worker's latest scrape names (None: not scraped, or no model named)."""
        w = self.workers.get(name)
        snap = w.snapshot if w is not None else None
        return snap.model if snap is not None else None

    # ---- evidence ------------------------------------------------------------------------------
    def worker(self, name: str, ts: float | None = None) -> WorkerInfo:
        """The worker's entry (created on first sight); ``ts`` is evidence it is alive."""
        w = self.workers.get(name)
        if w is None:
            w = self.workers[name] = WorkerInfo(name)
        if ts is not None and ts > w.last_seen:
            w.last_seen = ts
        return w

    def served(self, name: str, ts: float) -> WorkerInfo:
        """A request record says ``name`` served a request at ``ts``."""
        if not self._records_seen:
            self.records_seen = True
        w = self.worker(name, ts)
        if ts > w.last_served:
            self._traffic(name, w, ts)
        return w

    def _traffic(self, name: str, w: WorkerInfo, ts: float) -> None:
        """``w`` served at ``ts``, later than it last did: a down worker's first traffic since it went
        down turns it from left to blind."""
        if self.down_since:
            since = self.down_since.get((name, "worker"))
            if since is not None and w.last_served <= since < ts:
                self._left = None
        w.last_served = ts

    def forget(self, name: str) -> None:
        """Drop a worker only records named, once they stopped naming it (``exporter.core.cardinality``).
        A worker with a scrape or KV evidence of its own stays."""
        w = self.workers.get(name)
        if w is not None and w.snapshot is None and w.last_seen <= w.last_served:
            del self.workers[name]
            self._left = None
            self._pending.add(name)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        """A router scrape: a worker whose decision count rose since the last one served traffic."""
        prev = self.routers.get(snapshot.router)
        for worker, n in snapshot.decisions.items():
            if prev is not None and n > prev.decisions.get(worker, 0.0) and worker in self.workers:
                w = self.workers[worker]
                if scraped_at > w.last_served:
                    self._traffic(worker, w, scraped_at)
        if prev is None:
            self._left = None  # a traffic source: a down worker without traffic has left
        self.routers[snapshot.router] = snapshot
        down = frozenset(w for w, v in snapshot.healthy.items() if v == 0)
        before = self._router_down.get(snapshot.router, frozenset())
        if down != before:
            self._router_down[snapshot.router] = down
            for name in down - before:
                self._refer(name, 1)
            for name in before - down:
                self._refer(name, -1)

    def _refer(self, name: str, n: int) -> None:
        """One more (``n`` 1) or one fewer (-1) up series or router saying ``name`` is down."""
        refs = self._down_refs
        count = refs.get(name, 0) + n
        if count:
            refs[name] = count
        else:
            del refs[name]
        self._pending.add(name)

    # ---- what a worker is: its scrape, else its topology entry -------------------------------------
    def topo_of(self, worker: str) -> WorkerTopo | None:
        """The worker's topology entry, if a topology is configured and names it."""
        topo = self.topology
        return topo.worker(worker) if topo is not None and worker in topo else None

    def worker_capacity(self, name: str, w: WorkerInfo | None = None) -> int | None:
        """GPU blocks of the worker (its scrape, else its topology class); ``w``: its entry, when at hand."""
        if w is None:
            w = self.workers.get(name)
        if w is not None and w.snapshot is not None and w.snapshot.num_gpu_blocks:
            return w.snapshot.num_gpu_blocks
        t = self.topo_of(name)
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
            cap = snap.max_running or getattr(self.topo_of(name), "max_concurrency", None)
            if snap.running is not None and cap:
                parts.append(snap.running / cap)
            if parts:
                out[name] = max(parts)
        return out

    # ---- health --------------------------------------------------------------------------------
    def explicitly_down(self) -> set[str]:
        """Targets a scrape says are down (up = 0), and workers a router says are unhealthy."""
        if self._up_changes:  # up series written since the pool last looked: read them as they are
            down = {t for (t, _kind), v in dict(self.health.gauges.get(UP, {})).items() if v == 0}
            for names in self._router_down.values():
                down.update(names)
            return down
        return set(self._down_refs)

    def _is_down(self, name: str) -> bool:
        """``name in explicitly_down()``, without building the set."""
        if not self._up_changes:
            return name in self._down_refs
        up = self.health.gauges.get(UP, {})
        return up.get((name, "worker")) == 0 or up.get((name, "router")) == 0 \
            or any(name in names for names in self._router_down.values())

    def depart(self, name: str, ts: float) -> None:
        """Service discovery (or a reload) dropped the worker: it is out of the pool from now on,
        and no failing scrape of it is blindness."""
        self.departed.setdefault(name, ts)
        self.announced.add(name)
        self.down_since.pop((name, "worker"), None)
        self._left = None

    def rejoin(self, name: str, announced: bool = True) -> None:
        """The worker is a target (again): service discovery found it. ``announced``: its entering the
        pool will be a pool change (not for the workers found at start)."""
        if self.departed.pop(name, None) is not None:
            self._left = None
            self._pending.add(name)
            if self.health.gauges.get(UP, {}).get((name, "worker")) == 0:
                self._up_changes.add((name, "worker"))  # a target again: its failing scrape counts from now
        if announced:
            self.announced.add(name)

    def retire(self, name: str) -> None:
        """Forget a departed worker altogether (its series retired)."""
        self.departed.pop(name, None)
        self.workers.pop(name, None)
        self._left = None

    def is_healthy(self, worker: str, down: set[str] | None = None) -> bool:
        """Seen alive recently (record, scrape or KV batch) and not reported down by a scrape or router."""
        w = self.workers.get(worker)
        if w is None or self.time.now - w.last_seen > self.health_recency_s or worker in self.departed:
            return False
        return not self._is_down(worker) if down is None else worker not in down

    def track_down_targets(self) -> None:
        """Remember since when each scrape target has been failing (cleared when it answers again,
        or when it is no longer a target): the up series written since the last call, no others."""
        if not self._up_changes:
            return
        now = self.time.now
        up = self.health.gauges.get(UP, {})
        zero, down_since = self._zero, self.down_since
        for key in self.health.take(self._up_changes):
            if up.get(key) == 0:
                if key[1] != "worker" or key[0] not in self.departed:  # a departed worker is no target
                    down_since.setdefault(key, now)
                if key not in zero:
                    zero.add(key)
                    self._refer(key[0], 1)
            else:
                down_since.pop(key, None)
                if key in zero:
                    zero.discard(key)
                    self._refer(key[0], -1)
        self._left = None

    def blind_targets(self) -> int:
        """Targets that fail their scrape while traffic still reaches them.

        A router target that is down always blinds us. A worker target that is down blinds us
        only if it served traffic after its scrapes began to fail (records or router decisions
        show it); a worker whose traffic stopped when it went down has left the pool — a fleet
        event the chain reads in step 2 (migrations, pool changes), not broken telemetry. With no
        traffic source at all (no records, no router) every down target counts — for
        ``down_grace_s``: a worker down that long has left, whatever serves. A worker discovery
        dropped is no target and never counts.
        """
        return sum(1 for (target, kind) in self.down_since if not self.left_pool(target, kind))

    def left_pool(self, target: str, kind: str) -> bool:
        """A down worker target with no traffic since it went down (see :meth:`blind_targets`), or
        one down past ``down_grace_s``, or one that discovery dropped."""
        since = self.down_since.get((target, kind))
        if since is None or kind != "worker":
            return False
        if target in self.departed or self.time.now - since >= self.down_grace_s:
            return True
        if not (self.records_seen or self.routers):
            return False
        w = self.workers.get(target)
        return w is None or w.last_served <= since

    def liveness(self, name: str, down: set[str] | None = None) -> Liveness:
        """``up`` (healthy: in the pool), ``down`` (reported down, yet traffic still reaches it) or
        ``left`` (it left the pool: down with no traffic since, or silent past the health recency).

        A failing scrape target is down or left by :meth:`left_pool`. A worker only a router marks
        unhealthy is down while it still served within the health recency, else left. A worker
        nothing reports down that stopped giving any sign of life has aged out of the pool: left.
        Call :meth:`track_down_targets` first so that a newly failing scrape has its start.
        """
        down = self.explicitly_down() if down is None else down
        if name in self.departed:
            return "left"
        if self.is_healthy(name, down):
            return "up"
        if (name, "worker") in self.down_since:
            return "left" if self.left_pool(name, "worker") else "down"
        w = self.workers.get(name)
        if name in down and w is not None and self.time.now - w.last_served <= self.health_recency_s:
            return "down"
        return "left"

    def left_pool_targets(self) -> list[tuple[str, ...]]:
        """The down worker targets that left the pool (:meth:`left_pool`), in the order they went
        down. Kept between changes: found again only when a target's up state, a departure, a down
        worker's first traffic or the traffic sources changed, or a down worker's grace ran out."""
        self.track_down_targets()
        if self._left is None or self.time.now >= self._left_until:
            self._find_left()
        assert self._left is not None
        return self._left

    def left_workers(self) -> frozenset[str]:
        """The names of :meth:`left_pool_targets` (the same set object while they stay the same)."""
        self.left_pool_targets()
        return self._left_workers

    def _find_left(self) -> None:
        left = [key for key in self.down_since if self.left_pool(*key)]
        names = frozenset(t for t, _kind in left)
        if names != self._left_workers:
            self._left_workers = names
        self._left = left
        grace = self.down_grace_s
        self._left_until = min((since + grace for (t, kind), since in self.down_since.items()
                                if kind == "worker" and t not in names), default=math.inf)

    # ---- the pool ------------------------------------------------------------------------------
    def unchanged_for(self, worker: str) -> bool:
        """True when new evidence from ``worker`` cannot change the pool (so :meth:`note` may be
        skipped): it is in the pool, no member can have aged out yet, and no target's up state or
        router's health changed since the pool was last judged."""
        return (worker in self.pool and self.time.now <= self._stable_until
                and not self._up_changes and not self._pending)

    def note(self, worker: str, ts: float) -> bool:
        """Bring the pool up to date after new evidence from ``worker`` (already recorded at
        ``ts``); True when that is a pool change (counted by the caller)."""
        return self.note_all((worker,), ts)

    def note_all(self, workers: Iterable[str], ts: float) -> bool:
        """:meth:`note` for several workers' evidence at once: one pool change at most.

        Work that does not grow with the pool: while no member can have aged out, only these
        workers and those whose down state changed since the pool was last judged can have
        changed, and each is judged alone. Otherwise, a full :meth:`update`, which happens about
        once per health recency as members age.
        """
        if self.time.now > self._stable_until:
            return self.update(ts)
        self.track_down_targets()
        changed, self._pending = self._pending, set()
        pool, recency = self.pool, self.health_recency_s
        joined: list[str] = []
        gone: list[str] = []
        for group in (changed, workers):
            for name in group:
                if self.is_healthy(name):
                    if name not in pool:
                        joined.append(name)
                        self._stable_until = min(self._stable_until, self.workers[name].last_seen + recency)
                elif name in pool:
                    gone.append(name)
        if not joined and not gone:
            return False
        return self._set_pool((pool - frozenset(gone)) | frozenset(joined), ts)

    def update(self, ts: float) -> bool:
        """Recompute the healthy set; True when that is a pool change (counted by the caller)."""
        self.track_down_targets()
        self._pending.clear()
        pool = frozenset(w for w in self.workers if self.is_healthy(w))
        # Members only get fresher, so until then none of them can age out of the pool.
        self._stable_until = min((self.workers[w].last_seen for w in pool), default=-math.inf) \
            + self.health_recency_s
        return self._set_pool(pool, ts)

    def _set_pool(self, pool: frozenset[str], ts: float) -> bool:
        if pool == self.pool:
            return False
        before, self.pool = self.pool, pool
        moved = before ^ pool
        announced = bool(self.announced & moved)
        self.announced -= moved
        started = self.time.started_at
        # While the exporter is still discovering its workers, a growing set is not a change —
        # unless service discovery announced the worker that came or went.
        if before and (announced or (started is not None and ts - started >= self.health_recency_s)):
            self.epoch += 1
            self.changes.append(PoolChange(ts, len(before), len(pool), self.epoch))
            return True
        return False
