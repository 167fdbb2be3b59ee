"""The reference router in front of simulated engines, and its prefix index (its *belief*).

The router keeps, for stateful policies (``prefix-tree``, ``topology-aware``), a session table
(key → anchor worker) and an index of which worker holds which block: blocks are added when it
sends a request (optimistic) and removed by the engines' KV events. If events are lost the
belief goes stale, and ``predicted_cached_tokens`` drifts above what the engine reports.

Per request it measures its own index walk (wall time on a real clock, a per-block model on a
virtual one, plus the injectable ``walk_delay_s``),
follows the session anchor, migrates sessions whose worker left (soft: the KV is moved over
NVLink or the network; hard: the new worker recomputes), runs the fallback ladder for new and
cold sessions and submits to the engine. Its own state (index, sessions) changes at routing;
the ``prefixscope.request/v1`` record is built and emitted when the engine admits the request,
which under load is later than its arrival (``ts`` stays the arrival time, so records may reach
the sink slightly out of ``ts`` order). Until then the request counts towards its worker's load.
Given a :class:`~fleet.router_metrics.RouterMetrics`, it also counts each decision, lookup
outcome, predicted ratio and walk latency the way a real router's /metrics does (``metrics_page``).
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fleet.cache import Cleared, Removed, Stored
from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, EngineResult, Pending, RequestError, SimEngine
from fleet.fallback import FallbackLadder, LadderConfig
from fleet.policies import (
    POLICIES,
    STATELESS_POLICIES,
    Candidate,
    HashRing,
    PolicyParams,
    pick_consistent_hash,
    pick_hash_mod,
    pick_prefix_tree,
    pick_random,
    pick_round_robin,
    pick_topology_aware,
    preferred_classes,
)
from fleet.records import SCHEMA_NAME, RecordSink
from fleet.router_metrics import Lookup, Routed, RouterMetrics
from fleet.topology import Topology
from fleet.workloads import SimRequest

log = logging.getLogger("prefixscope.fleet.router")

WALK_S_PER_BLOCK = 1e-6  # modelled index-walk cost per prompt block on a virtual clock (≈ measured)


class BlockHolderIndex:
    """Block hash → bitmask of workers believed to hold it; walks a chain in one pass."""

    def __init__(self) -> None:
        self._mask: dict[int, int] = {}
        self._bit: dict[str, int] = {}
        self._blocks: dict[str, set[int]] = {}

    def _bit_of(self, worker: str) -> int:
        b = self._bit.get(worker)
        if b is None:
            b = self._bit[worker] = 1 << len(self._bit)
            self._blocks[worker] = set()
        return b

    def add(self, worker: str, hashes: Sequence[int]) -> None:
        bit, mask = self._bit_of(worker), self._mask
        for h in hashes:
            mask[h] = mask.get(h, 0) | bit
        self._blocks[worker].update(hashes)

    def remove(self, worker: str, hashes: Sequence[int]) -> None:
        bit = self._bit.get(worker)
        if bit is None:
            return
        mask, blocks = self._mask, self._blocks[worker]
        for h in hashes:
            m = mask.get(h, 0) & ~bit
            if m:
                mask[h] = m
            else:
                mask.pop(h, None)
            blocks.discard(h)

    def clear(self, worker: str) -> None:
        if worker in self._blocks:
            self.remove(worker, list(self._blocks[worker]))

    def blocks(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker is believed to hold (workers with none omitted)."""
        get = self._mask.get
        alive = get(hashes[0], 0) if hashes else 0
        depth_at: dict[int, int] = {}
        i = 0
        for i, h in enumerate(hashes):
            m = alive & get(h, 0)
            if m != alive:
                depth_at[alive & ~m] = i
                alive = m
                if not alive:
                    break
        else:
            i = len(hashes)
        if alive:
            depth_at[alive] = i
        out: dict[str, int] = {}
        for worker, bit in self._bit.items():
            for bits, d in depth_at.items():
                if bits & bit and d:
                    out[worker] = d
                    break
        return out


@dataclass(slots=True)
class RouterConfig:
    policy: str = "topology-aware"
    walk_delay_s: float = 0.0  # fault knob: added to every measured index walk
    placement: str = "aware"  # "blind": new sessions ignore where prefixes are cached (fault)
    class_routing: bool = True  # False: the GPU class is ignored when placing (fault)
    vnodes: int = 160
    params: PolicyParams = field(default_factory=PolicyParams)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    async_share: float = 1.0  # share of a GPU the background async-prefill lane gets
    downgrade_workers: tuple[str, ...] = ()  # workers serving topology.downgrade_model, if any
    # A prompt that reuses at most this share is cold (the fallback ladder's trigger). Whoever
    # composes the fleet hands in the threshold file's cold_reuse_share, so the router and the
    # exporter call the same requests cold; this default is the packaged file's.
    cold_share: float = 0.1


def import_prefix(engine: SimEngine, request_id: str, hashes: Sequence[int], token_ids: Sequence[int] | None = None,
                  lora_name: str | None = None, lora_id: int | None = None, cache_salt: str | None = None) -> None:
    """Soft migration: the session's blocks arrive over the interconnect and become resident.

    The engine has no KV-import call, so this reaches into its cache under its lock and emits
    the resulting KV events the way a KV connector's load would (with the blocks' tokens when
    they are known, and the LoRA adapter they were computed with).
    """
    with engine._lock:
        now = engine.clock.now()
        _, events = engine.cache.store(request_id, hashes, token_ids, lora_id=lora_id, lora_name=lora_name,
                                       cache_salt=cache_salt, at=now)
        engine.cache.release(request_id)
        engine._emit(events, now)


@dataclass(slots=True)
class RouteDecision:
    """One request on its way through the router: what each stage decided.

    ``choose`` sets worker, decision and (stateful policies) walk_s and predicted; ``migrate``
    sets migrated_from, kind and migrate_s; ``escalate`` may move the request to a fallback
    tier (tier, worker, model). The record is built from it when the engine admits the request.
    """

    req: SimRequest
    now: float  # arrival at the router: the record's ts
    key: str  # the session key (the request id when keyless)
    names: list[str]  # the healthy workers at arrival
    prev: str | None  # the worker the session was last sent to
    displaced: str | None  # the failed worker the session must leave
    model: str
    worker: str = ""
    decision: str = ""
    tier: str | None = None
    predicted: int | None = None
    walk_s: float | None = None
    best: int | None = None  # the longest prefix (blocks) any worker was believed to hold
    migrated_from: str | None = None
    kind: str | None = None  # migration kind: "soft" (KV moved) or "hard" (recomputed)
    migrate_s: float = 0.0


class Router:
    def __init__(self, topology: Topology, engines: Mapping[str, SimEngine], clock, *,
                 config: RouterConfig | None = None, sink: RecordSink | None = None,
                 pool: Sequence[str] | None = None, seed: int = 0, metrics: RouterMetrics | None = None) -> None:
        self.topology = topology
        self.engines = dict(engines)
        self.clock = clock
        self.config = config or RouterConfig()
        if self.config.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.config.policy!r} (choose from {', '.join(POLICIES)})")
        self.sink = sink
        self.metrics = metrics  # the router's own /metrics, in a real router's names (None: not kept)
        self.rng = random.Random(seed)
        self.pool: list[str] = list(pool if pool is not None else topology.names)
        self.healthy: set[str] = set(self.pool)
        self.drained: set[str] = set()
        self.index = BlockHolderIndex()
        self.ladder = FallbackLadder(self.config.ladder)
        self.sessions: dict[str, str] = {}  # session key -> anchor (or last) worker
        self.displaced: dict[str, str] = {}  # session key -> the failed worker it must leave
        self.anchored: dict[str, int] = dict.fromkeys(topology.names, 0)  # sessions placed per worker
        self.relaxed: dict[str, str] = {}  # relaxed key -> last worker (re-sticky)
        self._inflight: dict[str, list[float]] = {w: [] for w in topology.names}  # finish times (heaps)
        self._waiting: dict[str, set[str]] = {w: set() for w in topology.names}  # ids submitted, not admitted
        # Admissions may complete on another thread (the real-time fleet's tick loop).
        self._lock = threading.RLock()
        self._rr = 0
        self._ring: HashRing | None = None
        self.kv_events_seen: dict[str, int] = dict.fromkeys(topology.names, 0)
        self.kv_events_dropped: dict[str, int] = dict.fromkeys(topology.names, 0)
        self.kv_last_batch: dict[str, float] = {}
        self.served = 0
        self.deferred = 0  # requests whose admission (and record) came after their arrival
        self.unroutable = 0
        self.rejected = 0

    # -- fleet changes -------------------------------------------------------------------
    @property
    def stateless(self) -> bool:
        return self.config.policy in STATELESS_POLICIES

    def active(self) -> list[str]:
        return [w for w in self.pool if w in self.healthy]

    def add_worker(self, name: str, engine: SimEngine | None = None) -> None:
        if engine is not None:
            self.engines[name] = engine
        if name not in self.pool:
            self.pool.append(name)
        self._inflight.setdefault(name, [])
        self._waiting.setdefault(name, set())
        self.healthy.add(name)
        self.drained.discard(name)
        self._ring = None

    def fail_worker(self, name: str) -> None:
        """The worker died: its cache is gone, its sessions move hard."""
        self.healthy.discard(name)
        self.drained.discard(name)
        self.index.clear(name)
        self._waiting[name] = set()  # what waited there is no load on the worker that comes back
        self._ring = None
        # Its sessions move hard at their next request, even if it is back by then (empty).
        for key, w in self.sessions.items():
            if w == name:
                self.displaced[key] = name

    def drain_worker(self, name: str) -> None:
        """The worker leaves on purpose: it stops taking requests, its sessions move soft."""
        self.healthy.discard(name)
        self.drained.add(name)
        self._ring = None

    def restore_worker(self, name: str, restarted: bool) -> None:
        if restarted:
            self.index.clear(name)
        self.add_worker(name)

    def on_kv_events(self, worker: str, events: Sequence[Stored | Removed | Cleared], ts: float) -> None:
        """The engine's KV events (the router subscribes to every worker, like a precise router)."""
        engine = self.engines.get(worker)
        drop = engine.knobs.drop_kv_events if engine is not None else 0.0
        if drop > 0 and (drop >= 1 or self.rng.random() < drop):
            self.kv_events_dropped[worker] = self.kv_events_dropped.get(worker, 0) + len(events)
            return
        self.kv_events_seen[worker] = self.kv_events_seen.get(worker, 0) + len(events)
        self.kv_last_batch[worker] = ts
        for ev in events:
            if isinstance(ev, Stored):
                self.index.add(worker, ev.hashes)
            elif isinstance(ev, Removed):
                self.index.remove(worker, ev.hashes)
            else:
                self.index.clear(worker)

    # -- views ---------------------------------------------------------------------------
    def load(self, worker: str, now: float) -> int:
        """Requests sent to ``worker`` and not finished by ``now`` (waiting ones included)."""
        heap = self._inflight[worker]
        while heap and heap[0] <= now:
            heapq.heappop(heap)
        return len(heap) + len(self._waiting.get(worker, ()))

    @property
    def waiting(self) -> int:
        """Requests submitted to an engine and not yet admitted (no record yet)."""
        return sum(len(ids) for ids in self._waiting.values())

    def settle(self) -> None:
        """Run every engine with waiting requests to completion, so their records are emitted
        (the end of a run: nothing is left without a record)."""
        for engine in list(self.engines.values()):
            if engine.waiting:
                engine.finish_all()

    def _candidates(self, names: Sequence[str], matches: Mapping[str, int], now: float) -> list[Candidate]:
        topo = self.topology
        return [Candidate(n, self.load(n, now), topo.worker(n).max_concurrency, matches.get(n, 0),
                          self.anchored.get(n, 0)) for n in names]

    # -- routing -------------------------------------------------------------------------
    def _stateless_pick(self, key: str, cands: list[Candidate]) -> tuple[str, str]:
        p = self.config.policy
        if p == "random":
            return pick_random(cands, self.rng)
        if p == "round-robin":
            self._rr += 1
            return pick_round_robin(cands, self._rr)
        if p == "hash-mod":
            return pick_hash_mod(key, cands)
        if self._ring is None or self._ring.workers != tuple(c.name for c in cands):
            self._ring = HashRing([c.name for c in cands], self.config.vnodes)
        return pick_consistent_hash(key, self._ring)

    def _policy_pick(self, req: SimRequest, cands: list[Candidate]) -> tuple[str, str]:
        if self.config.policy == "prefix-tree":
            return pick_prefix_tree(cands, self.topology.block_size, self.config.params)
        if self.config.class_routing:
            return pick_topology_aware(cands, req.prompt_tokens, req.output_tokens, self.topology, self.config.params)
        # Class-blind: the same walk, told that every class fits.
        return pick_topology_aware(cands, 0, 0, self.topology, self.config.params)

    def _migration_target(self, old: str, cands: list[Candidate]) -> str:
        """Same NVLink domain, else same node, else anywhere; least loaded within (seed §4)."""
        topo = self.topology
        if self.config.policy == "topology-aware" and old in topo:
            for same in (lambda c: topo.domain_of(c.name) == topo.domain_of(old),
                         lambda c: topo.node_of(c.name) == topo.node_of(old)):
                near = [c for c in cands if same(c) and c.load < c.capacity]
                if near:
                    return min(near, key=lambda c: c.load / c.capacity).name
        return min(cands, key=lambda c: c.load / c.capacity).name

    def _warm_pick(self, req: SimRequest, cands: list[Candidate]) -> str | None:
        warm = [c for c in cands if self.topology.worker(c.name).warm_pool]
        if not warm:
            return None
        warm = [c for c in warm if c.load < c.capacity] or warm
        if self.config.class_routing and self.config.policy == "topology-aware":
            classes = preferred_classes(req.prompt_tokens, req.output_tokens, self.topology, [c.name for c in warm],
                                        self.config.params)
            warm = [c for c in warm if self.topology.worker(c.name).gpu_class in classes] or warm
        # ties (idle warm pool) go to the emptier cache, so cold prompts do not pile on one worker
        return min(warm, key=lambda c: (c.load / c.capacity, self.index.blocks(c.name) / c.capacity)).name

    def route(self, req: SimRequest) -> dict | None:
        """Route and submit one request. Returns its record when the engine admitted it at once;
        None when it waits for a slot (its record goes to the sink at admission), when no worker
        is healthy, or when the engine refused it."""
        with self._lock:
            return self._route(req)

    def _route(self, req: SimRequest) -> dict | None:
        now = self.clock.now()
        self._catch_up_engines()
        names = self.active()
        if not names:
            self.unroutable += 1
            return None
        key = req.session_key or req.request_id
        d = RouteDecision(req, now, key, names, prev=self.sessions.get(key), displaced=self.displaced.pop(key, None),
                          model=self.topology.model)
        self._choose(d)
        self._migrate(d)
        self._escalate(d)
        res = self._submit(d)
        if self.metrics is not None:
            self.metrics.observe(self._routed(d, accepted=res is not None))
        if res is None:
            return None
        self._remember(d)
        if isinstance(res, Pending):
            self.deferred += 1
            self._waiting.setdefault(d.worker, set()).add(req.request_id)
            res.add_done_callback(lambda result: self._admitted(d, result, waited=True))
            return None
        return self._admitted(d, res)

    def _catch_up_engines(self) -> None:
        """Engines admit lazily, when touched: bring those with waiting requests up to now, so
        their records go out and their load is current before the next request is placed."""
        for name, ids in list(self._waiting.items()):
            engine = self.engines.get(name)
            if ids and engine is not None:
                engine.tick()

    # choose: which worker, and why ------------------------------------------------------
    def _choose(self, d: RouteDecision) -> None:
        if self.stateless:
            d.worker, d.decision = self._stateless_pick(d.key, self._candidates(d.names, {}, d.now))
            return
        matches = self._walk(d)
        cands = self._candidates(d.names, matches, d.now)
        best = d.best = max(matches.values(), default=0)
        if d.displaced is not None:
            d.worker, d.decision = self._migration_target(d.displaced, cands), "migrate"
        elif d.prev is not None and d.prev in self.healthy:
            # Leave the anchor only when most of the prompt is cached elsewhere and not
            # there (the conversation moved devices); short shared runs do not pull it away.
            if best - matches.get(d.prev, 0) <= len(d.req.block_hashes) // 2:
                d.worker, d.decision = d.prev, "sticky"
            else:
                d.worker, d.decision = self._policy_pick(d.req, cands)
        elif d.prev is not None:
            d.worker, d.decision = self._migration_target(d.prev, cands), "migrate"
        else:
            self._place_new_session(d, cands, best)
        d.predicted = self._cached_prefix(d.req, matches.get(d.worker, 0))

    def _walk(self, d: RouteDecision) -> dict[str, int]:
        """The index walk: blocks of the prompt each worker is believed to hold; sets walk_s."""
        hashes = d.req.block_hashes
        t0 = time.perf_counter()
        matches = self.index.match(hashes)
        # Measured on a real clock; modelled on a virtual one, so that a replay does not
        # depend on how busy the machine running it is.
        spent = WALK_S_PER_BLOCK * len(hashes) if isinstance(self.clock, VirtualClock) else time.perf_counter() - t0
        d.walk_s = spent + self.config.walk_delay_s
        return matches

    def _place_new_session(self, d: RouteDecision, cands: list[Candidate], best: int) -> None:
        """A session without a worker: the fallback ladder for cold prompts, else the policy."""
        rk = self.ladder.relaxed_key(d.key)
        re_sticky = self.relaxed.get(rk) if rk is not None else None
        cold = best * self.topology.block_size <= self.config.cold_share * d.req.prompt_tokens
        if re_sticky is not None and re_sticky in self.healthy and cold and self.ladder.usable("re_sticky", d.now):
            d.worker, d.decision, d.tier = re_sticky, "fallback", "re_sticky"
        elif cold and self.ladder.usable("warm_pool", d.now) and (warm := self._warm_pick(d.req, cands)):
            d.worker, d.decision, d.tier = warm, "fallback", "warm_pool"
        else:
            hot = [c for c in cands if not self.topology.worker(c.name).warm_pool] or cands
            if self.config.placement == "blind":
                d.worker, d.decision = min(hot, key=lambda c: c.load / c.capacity).name, "least_loaded"
            else:
                d.worker, d.decision = self._policy_pick(d.req, hot)

    def _cached_prefix(self, req: SimRequest, blocks: int) -> int:
        """Tokens of ``blocks`` leading cached blocks the engine can reuse (never the last token)."""
        bs = self.topology.block_size
        return min(blocks, (req.prompt_tokens - 1) // bs) * bs

    # migrate: the session leaves a worker that is gone -----------------------------------
    def _migrate(self, d: RouteDecision) -> None:
        """Hard when the old worker failed (the new one recomputes), soft when it was drained
        (its blocks move over NVLink or the network, and the transfer delays the request)."""
        if d.displaced is not None and d.displaced != d.worker:
            d.migrated_from, d.kind = d.displaced, "hard"
            return
        prev = d.prev
        if prev is None or prev == d.worker or prev in self.healthy:
            return
        d.migrated_from = prev
        d.kind = "soft" if prev in self.drained and prev in self.engines else "hard"
        if d.kind != "soft":
            return
        hashes = d.req.block_hashes
        moved = self.engines[prev].lookup(hashes)
        if moved:
            toks = d.req.token_ids
            import_prefix(self.engines[d.worker], f"{d.req.request_id}-import", hashes[:moved],
                          None if toks is None else toks[: moved * self.topology.block_size],
                          d.req.lora_name, d.req.lora_id, d.req.cache_salt)
            d.migrate_s = self.topology.transfer_seconds(moved * self.topology.block_size, prev, d.worker)
            if d.predicted is not None:
                d.predicted = self._cached_prefix(d.req, moved)

    # escalate: long cold prefills go to the async lane or the smaller model ----------------
    def _escalate(self, d: RouteDecision) -> None:
        if d.tier not in (None, "warm_pool") or self.stateless:
            return
        lad = self.config.ladder
        est_prefill = (d.req.prompt_tokens - (d.predicted or 0)) / self.topology.worker(d.worker).prefill_tps
        if (est_prefill >= lad.async_min_prefill_s and d.req.output_tokens <= lad.async_max_output
                and self.ladder.usable("async_prefill", d.now)):
            d.tier = "async_prefill"
            # the async lane needs no warm cache: any worker of a fitting class with room
            cls = preferred_classes(d.req.prompt_tokens, d.req.output_tokens, self.topology, d.names,
                                    self.config.params)
            fit = [c for c in self._candidates(d.names, {}, d.now) if self.topology.worker(c.name).gpu_class in cls]
            d.worker = min(fit, key=lambda c: (c.load / c.capacity, self.index.blocks(c.name))).name
        elif (self.config.downgrade_workers and self.topology.downgrade_model and est_prefill >= lad.downgrade_ttft_s
              and self.ladder.usable("model_downgrade", d.now)):
            small = [w for w in self.config.downgrade_workers if w in self.healthy]
            if small:
                d.worker = min(small, key=lambda w: self.load(w, d.now))
                d.tier, d.model = "model_downgrade", self.topology.downgrade_model

    # the router's own metrics: what it decided, and what its index walk predicted ------------
    def _routed(self, d: RouteDecision, accepted: bool) -> Routed:
        if d.walk_s is None or d.predicted is None:
            return Routed(d.worker, accepted, None)
        ratio = min(1.0, d.predicted / max(1, d.req.prompt_tokens))
        # the prompts are ASCII and the tokenizer byte-level: a token is a character of the text
        return Routed(d.worker, accepted, Lookup(d.walk_s, ratio, pick_matched=d.predicted > 0,
                                                 any_matched=bool(d.best),
                                                 new_chars=max(0, d.req.prompt_tokens - d.predicted),
                                                 model=d.model, at=d.now))

    def metrics_page(self, worker_label: Callable[[str], str] = str) -> str:
        """The router's /metrics in its flavour ('' when it keeps none); workers labelled by
        ``worker_label`` (the real routers use the worker's URL)."""
        if self.metrics is None:
            return ""
        with self._lock:
            health = {w: w in self.healthy for w in self.pool}
        return self.metrics.render(health, self.config.policy, worker_label, prefix_aware=not self.stateless)

    # submit: hand the request to the engine ----------------------------------------------
    def _submit(self, d: RouteDecision) -> EngineResult | Pending | None:
        """The engine's answer; None when it refused the request (counted, logged once).

        The prompt's tokens go along with its hashes when the workload has them, so the engine's
        KV events carry ``token_ids`` as vLLM's do (trace replay has hashes only)."""
        req = d.req
        try:
            return self.engines[d.worker].submit(EngineRequest(
                request_id=req.request_id, token_ids=req.token_ids, block_hashes=req.block_hashes,
                prompt_tokens=req.prompt_tokens, max_tokens=max(1, req.output_tokens),
                output_tokens=max(1, req.output_tokens), arrival=d.now + d.migrate_s,
                lora_name=req.lora_name, lora_id=req.lora_id, cache_salt=req.cache_salt))
        except RequestError as exc:
            # The engine refuses it (as vLLM answers 400): count it, say so once, route on.
            self.rejected += 1
            if self.rejected == 1:
                log.warning("%s rejected request %s: %s — further rejections are only counted",
                            d.worker, req.request_id, exc)
            return None

    # remember: the router's belief after sending -----------------------------------------
    def _remember(self, d: RouteDecision) -> None:
        """Optimistic index entries, the session's anchor and its relaxed key."""
        worker, prev = d.worker, d.prev
        if not self.stateless:
            self.index.add(worker, d.req.block_hashes)
        if prev != worker:
            self.anchored[worker] = self.anchored.get(worker, 0) + 1
            if prev is not None:
                self.anchored[prev] = max(0, self.anchored.get(prev, 0) - 1)
        self.sessions[d.key] = worker
        rk = self.ladder.relaxed_key(d.key)
        if rk is not None:
            self.relaxed[rk] = worker

    def _admitted(self, r: RouteDecision, res: EngineResult, waited: bool = False) -> dict:
        """The engine admitted the request: account its load, build and emit its record."""
        with self._lock:
            if waited:
                self._waiting.get(r.worker, set()).discard(r.req.request_id)
            return self._record(r, res)

    def _record(self, r: RouteDecision, res: EngineResult) -> dict:
        req, now, worker, tier, migrate_s = r.req, r.now, r.worker, r.tier, r.migrate_s
        async_wait = None
        if tier == "async_prefill":
            # the async lane runs at background priority: a prefill takes 1/share as long there
            job = res.queue_s + res.prefill_s / max(1e-6, self.config.async_share)
            start = self.ladder.async_start(now, job)
            async_wait = start - now + job
        heapq.heappush(self._inflight[worker], res.finished_at)
        ttft = res.ttft_s + migrate_s + (async_wait - res.ttft_s if async_wait is not None else 0.0)
        self.ladder.observe(now, tier, prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
                            ttft_s=ttft, async_wait_s=async_wait)
        self.served += 1
        record = {
            "schema": SCHEMA_NAME,
            "ts": round(now, 6),
            "request_id": req.request_id,
            "session_key": req.session_key,
            "worker": worker,
            "model": r.model,
            "prompt_tokens": res.prompt_tokens,
            "output_tokens": res.output_tokens,
            "block_hashes": list(req.block_hashes),
            "block_size": req.block_size,
            "cached_tokens": res.cached_tokens,
            "predicted_cached_tokens": r.predicted,
            "ttft_s": ttft,
            "prefill_s": res.prefill_s,
            "queue_s": res.queue_s,
            "walk_s": r.walk_s,
            "decision": r.decision,
            "fallback_tier": tier,
            "async_wait_s": async_wait,
            "migrated_from": r.migrated_from,
            "migration_kind": r.kind,
            "migrate_s": migrate_s if r.kind == "soft" else None,
            "expert_signature": res.expert_signature,
            "admitted_by_affinity": res.admitted_by_affinity,
            "segment": req.segment,
        }
        # the request's LoRA adapter and tenant (its cache_salt), when it has them
        if req.lora_name is not None:
            record["lora_name"] = req.lora_name
        if req.cache_salt is not None:
            record["tenant"] = req.cache_salt
        if self.sink is not None:
            self.sink.emit(record)
        return record
