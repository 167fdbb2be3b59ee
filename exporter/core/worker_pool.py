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

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

import math
from collections import deque
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
        self.down_grace_s = down_grace_s  # a worker target down this long has left (never blind)
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
        self.records_seen = False  # a record source exists: it tells which workers serve traffic
        self._stable_until = -math.inf  # input time until which no pool member can age out
        self._up_writes = -1  # Health's write count of the up gauges at the last pool update
        self._down: set[str] = set()  # explicitly down at the last full update (up gauges, routers)

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
        self.records_seen = True
        w = self.worker(name, ts)
        w.last_served = max(w.last_served, ts)
        return w

    def forget(self, name: str) -> None:
        """Drop a worker only records named, once they stopped naming it (``exporter.core.cardinality``).
        A worker with a scrape or KV evidence of its own stays."""
        w = self.workers.get(name)
        if w is not None and w.snapshot is None and w.last_seen <= w.last_served:
            del self.workers[name]

    def needs_update(self, worker: str) -> bool:
        """Whether a record served by ``worker`` may change the pool (else :meth:`update` is skipped)."""
        return not self.unchanged_for(worker)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        """A router scrape: a worker whose decision count rose since the last one served traffic."""
        prev = self.routers.get(snapshot.router)
        for worker, n in snapshot.decisions.items():
            if prev is not None and n > prev.decisions.get(worker, 0.0) and worker in self.workers:
                self.workers[worker].last_served = max(self.workers[worker].last_served, scraped_at)
        self.routers[snapshot.router] = snapshot

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
        down = {t for (t, _kind), v in dict(self.health.gauges.get(UP, {})).items() if v == 0}
        for snap in self.routers.values():
            down.update(w for w, v in snap.healthy.items() if v == 0)
        return down

    def depart(self, name: str, ts: float) -> None:
        """Service discovery (or a reload) dropped the worker: it is out of the pool from now on,
        and no failing scrape of it is blindness."""
        self.departed.setdefault(name, ts)
        self.announced.add(name)
        for key in [k for k in self.down_since if k[0] == name and k[1] == "worker"]:
            del self.down_since[key]

    def rejoin(self, name: str, announced: bool = True) -> None:
        """The worker is a target (again): service discovery found it. ``announced``: its entering the
        pool will be a pool change (not for the workers found at start)."""
        self.departed.pop(name, None)
        if announced:
            self.announced.add(name)

    def is_healthy(self, worker: str, down: set[str] | None = None) -> bool:
        """Seen alive recently (record, scrape or KV batch) and not reported down by a scrape or router."""
        w = self.workers.get(worker)
        if w is None or self.time.now - w.last_seen > self.health_recency_s or worker in self.departed:
            return False
        return worker not in (down if down is not None else self.explicitly_down())

    def track_down_targets(self) -> None:
        """Remember since when each scrape target has been failing (cleared when it answers again)."""
        now = self.time.now
        up = dict(self.health.gauges.get(UP, {}))
        for key, v in up.items():
            if v == 0:
                self.down_since.setdefault(key, now)
            else:
                self.down_since.pop(key, None)
        for key in [k for k in self.down_since if k not in up]:  # no longer a target
            del self.down_since[key]

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
        return [key for key in self.down_since if self.left_pool(*key)]

    # ---- the pool ------------------------------------------------------------------------------
    def unchanged_for(self, worker: str) -> bool:
        """True when new evidence from ``worker`` cannot change the pool (so :meth:`update` may be
        skipped): it is in the pool, no member can have aged out yet, and no scrape target changed
        its up state since the last full update (routers change the pool only via observe_router)."""
        return (worker in self.pool and self.time.now <= self._stable_until
                and self.health.gauge_writes(UP) == self._up_writes)

    def note(self, worker: str, ts: float) -> bool:
        """Bring the pool up to date after new evidence from ``worker`` (already recorded at
        ``ts``); True when that is a pool change (counted by the caller).

        Work that does not grow with the pool: while no member can have aged out and no up
        gauge or router changed since the last full update (:meth:`unchanged_for`'s conditions),
        only this worker can have changed — it joins the pool if it is healthy. Otherwise, a
        full :meth:`update`, which happens about once per health recency as members age.
        """
        if self.unchanged_for(worker):
            return False
        if worker in self.pool or self.time.now > self._stable_until \
                or self.health.gauge_writes(UP) != self._up_writes:
            return self.update(ts)
        w = self.workers.get(worker)
        if w is None or self.time.now - w.last_seen > self.health_recency_s or worker in self._down:
            return False  # not healthy: the full update would leave the pool as it is
        self._stable_until = min(self._stable_until, w.last_seen + self.health_recency_s)
        return self._set_pool(self.pool | {worker}, ts)

    def update(self, ts: float) -> bool:
        """Recompute the healthy set; True when that is a pool change (counted by the caller)."""
        self._up_writes = self.health.gauge_writes(UP)
        self.track_down_targets()
        down = self._down = self.explicitly_down()
        pool = frozenset(w for w in self.workers if self.is_healthy(w, down))
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
