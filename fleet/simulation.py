"""The simulation driver: a workload and a scenario over the reference router and engines.

On a :class:`~fleet.clock.VirtualClock` the driver jumps from one request arrival to the next,
so ten simulated minutes take seconds; fleet actions (knobs, cache resets, failures, drains,
scale-out, scale-in, rolling restarts) fire at their scenario times, and every ``sample_every_s`` the engines' gauges and
counters are sampled (what a scrape of their /metrics would read). :func:`signals` turns a run
into the raw value behind each checklist item of ``prefixscope/catalog.py`` for a time window.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.cache import MEDIUM_GPU, Removed, Stored
from fleet.clock import Clock, VirtualClock
from fleet.engine import SimEngine, WorkerSpec
from fleet.records import RecordSink
from fleet.router import Router, RouterConfig, import_prefix
from fleet.router_metrics import RouterMetrics
from fleet.scenarios import Action, Scenario
from fleet.topology import Topology, WorkerTopo
from fleet.workers import WorkerFleet
from fleet.workloads import SimRequest, WorkloadGenerator

THRASH_WINDOW_S = 300.0  # a block stored again this soon after its eviction is thrash (the rate window)
# Prefix instability, as the check reads it: a root branch stored with a first block not seen as a
# root within ROOT_WINDOW_S whose opening (ROOT_OPENING_BLOCKS blocks) equals a recent root's from
# block 1 or 2 on, over at least 8 blocks (the ground truth is written apart from the exporter's).
ROOT_WINDOW_S = 300.0
ROOT_OPENING_BLOCKS = 32
SPEC_TOKENS = 3  # speculative decoding on, so its acceptance counters exist
SPEC_ACCEPTANCE = 0.85  # per-position acceptance: ≈ 0.73 accepted/draft with 3 draft tokens
# vLLM's --kv-cache-metrics (sampled block residency histograms), at vLLM's default
# --kv-cache-metrics-sample. Off unless asked for (the real-time fleet, hence the demo, asks): the
# presets are sized for full-size caches, and the steady-state runs that shrink the caches to fill
# them quickly read a retention of seconds where a preset's surge holds a small cache, which full-size
# caches never see (cache-pressure's thrashing worker still keeps an untouched block for minutes).
KV_CACHE_METRICS = False
KV_CACHE_METRICS_SAMPLE = 0.01


def worker_spec(topology: Topology, w: WorkerTopo, seed: int = 0, kv_cache_metrics: bool = KV_CACHE_METRICS) -> WorkerSpec:
    """The worker's engine; ``kv_cache_metrics``: as vLLM with ``--kv-cache-metrics``."""
    return WorkerSpec(name=w.name, model=topology.model, gpu_class=w.gpu_class, prefill_tps=w.prefill_tps,
                      decode_tps=w.decode_tps, num_gpu_blocks=w.kv_blocks, block_size=topology.block_size,
                      max_running=w.max_concurrency, gpus=w.gpus, spec_tokens=SPEC_TOKENS,
                      spec_acceptance=SPEC_ACCEPTANCE, kv_cache_metrics=kv_cache_metrics,
                      kv_cache_metrics_sample=KV_CACHE_METRICS_SAMPLE, seed=seed)


def with_block_size(topology: Topology, block_size: int) -> Topology:
    """The topology with blocks of ``block_size`` tokens and the same KV capacity in tokens.

    A worker's ``kv_blocks`` counts engine blocks of the topology's ``block_size``; a trace that
    hashes 512-token blocks (Mooncake) must see the same bytes of KV cache, i.e. 32× fewer of
    its blocks than 16-token engine blocks (rounded down: a partial block holds nothing).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if block_size == topology.block_size:
        return topology
    workers = tuple(replace(w, kv_blocks=max(1, w.kv_blocks * topology.block_size // block_size))
                    for w in topology.workers)
    return replace(topology, workers=workers, block_size=block_size)


@dataclass(slots=True)
class Sample:
    t: float  # seconds since the start
    workers: dict[str, dict[str, float]]  # worker -> gauges and cumulative counters


@dataclass
class SimResult:
    scenario: Scenario
    topology: Topology
    router: Router
    engines: dict[str, SimEngine]
    records: list[dict]
    samples: list[Sample]
    start: float  # clock time of t = 0
    wall_s: float
    events: list[tuple[float, str]] = field(default_factory=list)  # (t, what happened)
    # (ts, NVLink domains holding the longest cached prefix, chosen worker) per request
    placements: list[tuple[float, frozenset[str], str]] = field(default_factory=list)
    # per worker, (ts, GPU blocks stored, of those evicted from it within THRASH_WINDOW_S) per event batch
    evictions: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    # (ts, first block, opening tokens) of every GPU root branch stored with its tokens
    roots: list[tuple[float, int, tuple[int, ...]]] = field(default_factory=list)


class Simulation:
    def __init__(self, scenario: Scenario, topology: Topology, *, policy: str | None = None,
                 clock: Clock | None = None, sink: RecordSink | None = None, duration_s: float | None = None,
                 seed: int | None = None, sample_every_s: float = 5.0, track_placement: bool = True,
                 prewarm: bool = True, fleet: WorkerFleet | None = None,
                 requests: Iterable[SimRequest] | None = None, router_metrics: RouterMetrics | None = None,
                 cold_share: float | None = None, kv_cache_metrics: bool = KV_CACHE_METRICS) -> None:
        """``kv_cache_metrics``: the engines it builds run as vLLM with ``--kv-cache-metrics`` (given a
        ``fleet``, its workers' own specs say)."""
        self.scenario = scenario
        self.topology = topology
        self.clock = clock or VirtualClock()
        self.start = self.clock.now()
        self.duration_s = duration_s if duration_s is not None else scenario.duration_s
        self.seed = scenario.seed if seed is None else seed
        self.sample_every_s = sample_every_s
        self.records: list[dict] = []
        self.samples: list[Sample] = []
        self.events: list[tuple[float, str]] = []
        self.track_placement = track_placement
        self.placements: list[tuple[float, frozenset[str], str]] = []
        self.evictions: dict[str, list[tuple[float, int, int]]] = {}
        self._evicted: dict[str, dict[int, float]] = {}  # worker -> evicted hash -> when
        self.roots: list[tuple[float, int, tuple[int, ...]]] = []
        self._outer_sink = sink
        self._fresh: list[dict] = []  # records emitted since the run loop last handed them on
        self.fleet = fleet
        if fleet is None:
            self.engines = {w.name: SimEngine(worker_spec(topology, w, self.seed, kv_cache_metrics), self.clock,
                                              on_events=self._events_for(w.name)) for w in topology.workers}
        else:  # real workers (HTTP, /metrics, ZMQ): the router drives their engines in-process
            self.engines = {}
            for w in topology.workers:
                self._adopt(w.name)
        initial = topology.names[: scenario.initial_workers] if scenario.initial_workers else topology.names
        # The workers service discovery lists (a pod that exists and is ready): the initial pool,
        # those that join, less those scaled in or restarting. A failed or drained worker stays
        # listed (its pod is still there). :meth:`_listing_changed` says when it changes.
        self.listed: list[str] = list(initial)
        cfg = RouterConfig(policy=policy or scenario.policy)
        if cold_share is not None:  # the threshold file's, from whoever composes the run
            cfg = replace(cfg, cold_share=cold_share)
        self._configure(cfg, scenario.router)
        # router_metrics may outlive this run: the CLI keeps one across scenarios, as one router process would
        self.router = Router(topology, self.engines, self.clock, config=cfg, sink=self, pool=initial, seed=self.seed,
                             metrics=router_metrics)
        self.workload = WorkloadGenerator(scenario.phases(), self.duration_s, self.seed, topology.block_size)
        self._requests = requests  # a replayed trace instead of the scenario's workload
        # the run's progress, kept between pause_before and run
        self._heap: list[tuple[float, int, Callable[[], None], str]] | None = None
        self._stream: Iterator[SimRequest] | None = None
        self._pending: SimRequest | None = None  # taken from the stream, not routed yet
        self._paused_at: float | None = None
        self._routed = _stream_digest()  # every request routed so far (continue_as compares)
        # Operators pre-warm the tenants' system prompts on every worker when it starts, so a
        # tenant's first session is not a cold miss and its sessions can spread.
        self._prewarm = self.workload.shared_prompts() if prewarm and requests is None else []
        for name in self.engines:  # standby workers too: they are warmed before they join
            self._warm(name)

    # the router's sink (called when an engine admits a request): keep every record, pass it on
    def emit(self, record: dict) -> None:
        self.records.append(record)
        if self.track_placement:
            self._placement(record)
        self._fresh.append(record)
        if self._outer_sink is not None:
            self._outer_sink.emit(record)

    def _hand_on(self, on_request: Callable[[dict | None], None] | None) -> None:
        """Give the records emitted since the last call to ``on_request`` (None if there were none:
        it is still called once per routed request)."""
        fresh, self._fresh = self._fresh, []
        if on_request is None:
            return
        for record in fresh or (None,):
            on_request(record)

    def close(self) -> None:
        if self._outer_sink is not None:
            self._outer_sink.close()

    def _warm(self, name: str) -> None:
        for i, shared in enumerate(self._prewarm):
            import_prefix(self.engines[name], f"prewarm-{i}-{name}", shared.block_hashes, shared.token_ids,
                          shared.lora_name, shared.lora_id, shared.cache_salt)

    def _adopt(self, name: str) -> SimEngine:
        """Take a fleet worker's (new) engine; its KV events go to the publisher and the router."""
        engine = self.fleet[name].engine  # type: ignore[index]
        publish, ours = engine.on_events, self._events_for(name)

        def tee(events: list, ts: float) -> None:
            if publish is not None:
                publish(events, ts)
            ours(events, ts)
        engine.on_events = tee
        self.engines[name] = engine
        router = getattr(self, "router", None)
        if router is not None:
            router.engines[name] = engine
        return engine

    def _thrash(self, worker: str, events: list, ts: float) -> None:
        """Ground truth for cache pressure: stores of blocks the worker itself evicted recently."""
        evicted = self._evicted.setdefault(worker, {})
        stored = restored = 0
        for ev in events:
            if isinstance(ev, Removed):
                evicted.update(dict.fromkeys(ev.hashes, ts))
            elif isinstance(ev, Stored):
                stored += len(ev.hashes)
                for h in ev.hashes:
                    at = evicted.pop(h, None)
                    restored += at is not None and ts - at <= THRASH_WINDOW_S
            else:  # a reset is not eviction
                evicted.clear()
        if stored:
            self.evictions.setdefault(worker, []).append((ts, stored, restored))

    def _roots(self, events: list, ts: float) -> None:
        """Ground truth for prefix instability: the root branches stored, with their opening tokens."""
        for ev in events:
            if isinstance(ev, Stored) and ev.parent is None and ev.token_ids and ev.medium == MEDIUM_GPU:
                self.roots.append((ts, ev.hashes[0], tuple(ev.token_ids[:ROOT_OPENING_BLOCKS * ev.block_size])))

    def _events_for(self, worker: str) -> Callable[[list, float], None]:
        def cb(events: list, ts: float) -> None:
            self._thrash(worker, events, ts)
            self._roots(events, ts)
            router = getattr(self, "router", None)
            if router is not None:
                router.on_kv_events(worker, events, ts)
        return cb

    @staticmethod
    def _configure(cfg: RouterConfig, overrides: dict[str, Any]) -> None:
        for k, v in overrides.items():
            if k == "async_slots":
                cfg.ladder = replace(cfg.ladder, async_slots=int(v))
            else:
                setattr(cfg, k, v)

    # -- actions -------------------------------------------------------------------------
    def _targets(self, a: Action, rep: int) -> list[str]:
        names = list(a.workers) or [w.name for w in self.topology.workers if a.node in ("*", w.node)]
        names = [n for n in names if n in self.engines]
        if a.rotate and names:
            return [names[rep % len(names)]]
        return names

    def _schedule(self) -> list[tuple[float, int, Callable[[], None], str]]:
        heap: list[tuple[float, int, Callable[[], None], str]] = []
        seq = 0

        def push(t: float, fn: Callable[[], None], what: str) -> None:
            nonlocal seq
            if t <= self.duration_s:
                seq += 1
                heapq.heappush(heap, (t, seq, fn, what))

        sc = self.scenario
        if sc.fault_router:
            push(sc.fault_at_s, lambda: self._configure(self.router.config, dict(sc.fault_router)),
                 f"router: {dict(sc.fault_router)}")
            if "async_slots" in sc.fault_router:
                push(sc.fault_at_s, lambda: setattr(self.router.ladder, "config", self.router.config.ladder), "ladder")
        for a in sc.actions:
            end = min(a.until if a.until is not None else self.duration_s, self.duration_s)
            t, rep = a.at, 0
            while t <= end:
                for w in self._targets(a, rep):
                    self._schedule_action(push, a, t, w)
                if a.every is None:
                    break
                t += a.every
                rep += 1
        for i in range(int(self.duration_s // self.sample_every_s) + 1):
            push(i * self.sample_every_s, self._sample, "")
        return heap

    def _schedule_action(self, push: Callable, a: Action, t: float, w: str) -> None:
        router = self.router
        if a.action == "set_knob":
            push(t, lambda: setattr(self.engines[w].knobs, a.knob, a.value), f"{w}: {a.knob} = {a.value}")
        elif a.action == "reset_cache":
            push(t, lambda: self.engines[w].reset_cache(), f"{w}: cache reset")
        elif a.action == "add_worker":
            push(t, lambda: self.add_worker(w), f"{w}: joins the pool")
        elif a.action == "remove_worker":
            push(t, lambda: self.remove_worker(w), f"{w}: scaled in")
        elif a.action == "restart_worker":
            push(t, lambda: self.stop_for_restart(w), f"{w}: stopped for a rolling restart")
            push(t + (a.restore_after or 0.0), lambda: self.back_from_restart(w), f"{w}: back from its restart")
        elif a.action == "fail":
            push(t, lambda: self.fail_worker(w), f"{w}: fails")
            if a.restore_after:
                push(t + a.restore_after, lambda: self.restart_worker(w), f"{w}: restarted")
        elif a.action == "drain":
            push(t, lambda: router.drain_worker(w), f"{w}: drains")
            if a.restore_after:
                push(t + a.restore_after, lambda: router.restore_worker(w, restarted=False), f"{w}: back in the pool")

    # -- the fleet as service discovery lists it ----------------------------------------------
    def _list(self, w: str, listed: bool) -> None:
        if listed == (w in self.listed):
            return
        if listed:
            self.listed.append(w)
        else:
            self.listed.remove(w)
        self._listing_changed()

    def _listing_changed(self) -> None:
        """The listed workers changed (a subclass follows them: ``lab.harness`` writes a discovery file)."""

    def add_worker(self, w: str) -> None:
        """Scale-out: the worker joins the pool and is listed; one that was stopped starts as a new
        process (empty, then pre-warmed)."""
        if not self.engines[w].knobs.healthy:
            self._start_again(w)
        self.router.add_worker(w)
        self._list(w, True)

    def remove_worker(self, w: str) -> None:
        """Scale-in: the worker leaves the pool on purpose (its sessions move soft), is no longer
        listed, and its process stops."""
        self.router.drain_worker(w)
        self._list(w, False)
        self.engines[w].knobs.healthy = False
        if self.fleet is not None:
            self.fleet.kill(w)

    def stop_for_restart(self, w: str) -> None:
        """A rolling restart's first half: drained and unlisted (as a pod that terminates), then stopped."""
        self.remove_worker(w)

    def back_from_restart(self, w: str) -> None:
        """... and its second half: a new process (empty, then pre-warmed) back in the pool and listed."""
        self.restart_worker(w)
        self._list(w, True)

    def _start_again(self, w: str) -> None:
        if self.fleet is not None:
            self.fleet.restart(w)
            self._adopt(w)
        else:
            eng = self.engines[w]
            eng.reset_cache()  # a restarted engine comes back empty
            eng.knobs.healthy = True

    def fail_worker(self, w: str) -> None:
        """The worker dies: the router takes it out of the pool (its sessions migrate), the process goes."""
        self.engines[w].knobs.healthy = False
        self.router.fail_worker(w)
        if self.fleet is not None:
            self.fleet.kill(w)

    def restart_worker(self, w: str) -> None:
        """The worker comes back as a fresh process (empty cache, KV-event sequence 0) and rejoins."""
        self._start_again(w)
        self.router.restore_worker(w, restarted=True)
        self._warm(w)

    def _sample(self) -> None:
        t = self.clock.now() - self.start
        out: dict[str, dict[str, float]] = {}
        for name, eng in self.engines.items():
            eng.tick()
            running, waiting = eng.load()
            c = eng.counters
            out[name] = {
                "kv_usage": eng.kv_usage, "running": running, "waiting": waiting,
                "max_running": eng.spec.max_running, "resident_blocks": eng.cache.resident_blocks,
                "capacity_blocks": eng.spec.num_gpu_blocks, "prefix_queries": c.prefix_queries,
                "prefix_hits": c.prefix_hits, "spec_draft_tokens": c.spec_draft_tokens,
                "spec_accepted_tokens": c.spec_accepted_tokens,
                "in_pool": float(name in self.router.pool and name in self.router.healthy),
            }
        self.samples.append(Sample(t, out))

    # -- the run -------------------------------------------------------------------------
    def run(self, on_request: Callable[[dict | None], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> SimResult:
        """Run on the virtual clock (or pace a real clock: the clock's sleep does the waiting).

        After :meth:`pause_before` (and :meth:`continue_as`) the run goes on from where it paused.
        """
        wall = time.perf_counter()
        self._begin()
        virtual = isinstance(self.clock, VirtualClock)
        stopped = self._drive(None, on_request, should_stop, virtual)
        if not stopped and (should_stop is None or not should_stop()):
            self._fire_until(self.duration_s, virtual, inclusive=True)
            self._goto(self.duration_s, virtual)
        self.router.settle()  # requests still waiting for a slot are admitted and recorded
        if self._fresh:
            self._hand_on(on_request)
        return SimResult(self.scenario, self.topology, self.router, self.engines, self.records, self.samples,
                         self.start, time.perf_counter() - wall, self.events, self.placements, self.evictions,
                         self.roots)

    def pause_before(self, t: float, on_request: Callable[[dict | None], None] | None = None) -> None:
        """Route every request and fire every scheduled event before ``t`` seconds, then return.

        :meth:`run` goes on from there as if it had never stopped; :meth:`continue_as` first
        swaps in another scenario that shares everything before ``t``. A process that forks here
        has a snapshot of the fleet it can continue once per scenario (``lab.harness.run_family``).
        """
        self._begin()
        if self._paused_at is not None and t < self._paused_at:
            raise ValueError(f"already paused at {self._paused_at:g} s, cannot pause before {t:g} s")
        virtual = isinstance(self.clock, VirtualClock)
        self._drive(t, on_request, None, virtual)
        self._fire_until(t, virtual, inclusive=False)
        self._paused_at = t

    def continue_as(self, scenario: Scenario, duration_s: float | None = None) -> None:
        """Go on from the pause as ``scenario`` (run for ``duration_s``, default its own length).

        Allowed only when ``scenario`` would have produced exactly this fleet up to the pause: the
        same router, pool, seed and first workload, every change of its own (fault, actions,
        workload phases) at or after the pause, and its request stream up to the pause the one
        this run routed (checked request by request). Continuing is then the same as having run
        ``scenario`` from the start.
        """
        at = self._paused_at
        if at is None:
            raise ValueError("continue_as needs a run paused with pause_before")
        problems = shared_prefix_problems(self.scenario, scenario, at)
        duration = scenario.duration_s if duration_s is None else duration_s
        if duration < at:
            problems.append(f"it ends at {duration:g} s, before the pause")
        if problems:
            raise ValueError(f"{scenario.name} cannot continue a run of {self.scenario.name} paused at {at:g} s: "
                             + "; ".join(problems))
        workload = WorkloadGenerator(scenario.phases(), duration, self.seed, self.topology.block_size)
        stream = workload.requests() if self._requests is None else (
            r for r in self._requests if r.t <= duration)
        digest, pending = _digest_until(stream, at)
        if digest != self._routed.digest():
            raise ValueError(f"{scenario.name}'s requests before {at:g} s differ from those of "
                             f"{self.scenario.name}: it cannot continue that run")
        self.scenario, self.duration_s, self.workload = scenario, duration, workload
        self._stream, self._pending = stream, pending
        # its own schedule from the pause on (what came before was the same for both and has run)
        self._heap = [e for e in self._schedule() if e[0] >= at]
        heapq.heapify(self._heap)

    def _begin(self) -> None:
        if self._heap is None:
            self._heap = self._schedule()
            self._stream = self.workload.requests() if self._requests is None else (
                r for r in self._requests if r.t <= self.duration_s)

    def _fire_until(self, t: float, virtual: bool, inclusive: bool) -> None:
        """Fire the scheduled events at or before ``t`` (before it, when not ``inclusive``)."""
        heap = self._heap
        assert heap is not None
        while heap and (heap[0][0] <= t if inclusive else heap[0][0] < t):
            at, _, fn, what = heapq.heappop(heap)
            self._goto(at, virtual)
            fn()
            if what:
                self.events.append((at, what))

    def _drive(self, stop_before: float | None, on_request: Callable[[dict | None], None] | None,
               should_stop: Callable[[], bool] | None, virtual: bool) -> bool:
        """Route requests in time order, the scheduled events between them; True when ``should_stop``
        ended the run. With ``stop_before``, the first request at or after it waits (pending)."""
        assert self._stream is not None
        while True:
            req = self._pending if self._pending is not None else next(self._stream, None)
            if req is None:
                return False
            self._pending = req
            if stop_before is not None and req.t >= stop_before:
                return False
            if should_stop is not None and should_stop():
                return True
            self._pending = None
            self._fire_until(req.t, virtual, inclusive=True)
            self._goto(req.t, virtual)
            _digest_request(self._routed, req)
            self.router.route(req)
            self._hand_on(on_request)

    def _placement(self, record: dict) -> None:
        """Ground truth for topology-aware placement: where the longest cached prefix lives.

        Looked up at admission: the request's own blocks only become visible at the end of its
        prefill, so the caches still show what the request faced.
        """
        hashes = record["block_hashes"]
        depth = {name: eng.cache.match(hashes) for name, eng in self.engines.items()}
        best = max(depth.values(), default=0)
        if best > 0:
            domains = frozenset(self.topology.domain_of(n) for n, d in depth.items() if d == best)
            self.placements.append((record["ts"], domains, record["worker"]))

    def _goto(self, t: float, virtual: bool) -> None:
        target = self.start + t
        if virtual:
            self.clock.set(target)  # type: ignore[attr-defined]
        else:
            self.clock.sleep(target - self.clock.now())


def shared_prefix_problems(ran: Scenario, other: Scenario, at: float) -> list[str]:
    """Why ``other`` could not have run the same fleet as ``ran`` up to ``at`` seconds (none: it could).

    Before ``at`` both must have the same router, pool, seed and first workload, and neither may
    change anything (fault, workload phase, actions): the request streams are compared too, by
    :meth:`Simulation.continue_as`.
    """
    problems = []
    for what in ("policy", "initial_workers", "workload", "router", "seed"):
        if getattr(ran, what) != getattr(other, what):
            problems.append(f"its {what} differs")
    for sc in (ran, other):
        changes = [sc.fault_at_s, *(a.at for a in sc.actions)]
        if min(changes) < at:
            problems.append(f"{sc.name} changes the fleet at {min(changes):g} s, before the pause")
    return problems


def requests_digest(scenario: Scenario, until_s: float, duration_s: float | None = None, seed: int | None = None,
                    block_size: int = 16) -> bytes:
    """A digest of ``scenario``'s requests before ``until_s``: equal digests, equal streams up to there
    (what :meth:`Simulation.continue_as` checks; callers group scenarios by it)."""
    duration = scenario.duration_s if duration_s is None else duration_s
    stream = WorkloadGenerator(scenario.phases(), duration, scenario.seed if seed is None else seed,
                               block_size).requests()
    return _digest_until(stream, until_s)[0]


def _digest_until(stream: Iterator[SimRequest], at: float) -> tuple[bytes, SimRequest | None]:
    """The digest of the requests before ``at``, and the first one at or after it (taken from ``stream``)."""
    digest = _stream_digest()
    for req in stream:
        if req.t >= at:
            return digest.digest(), req
        _digest_request(digest, req)
    return digest.digest(), None


def _stream_digest() -> Any:
    return hashlib.blake2b(digest_size=16)


def _digest_request(digest: Any, r: SimRequest) -> None:
    """Add what makes ``r`` this request: its identity, timing and sizes, its last block hash (a
    chain hash: it stands for every block before it) and the tokens after the last full block."""
    last = r.block_hashes[-1] if r.block_hashes else None
    tail = tuple(r.token_ids[len(r.block_hashes) * r.block_size:]) if r.token_ids else ()
    digest.update(repr((r.t, r.request_id, r.session_key, r.conversation, r.turn, r.prompt_tokens,
                        r.output_tokens, r.segment, r.kind, r.lora_name, r.lora_id, len(r.block_hashes), last,
                        tail, *((r.cache_salt,) if r.cache_salt is not None else ()))).encode())


class ScaledClock:
    """Real time running ``speed`` times faster (the demo's ``--speed``)."""

    def __init__(self, speed: float = 1.0, start: float | None = None) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self._wall0 = time.time()
        self._t0 = self._wall0 if start is None else start

    def now(self) -> float:
        return self._t0 + (time.time() - self._wall0) * self.speed

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.speed)


def run_scenario(scenario: Scenario, topology: Topology, **kwargs: Any) -> SimResult:
    sim = Simulation(scenario, topology, **kwargs)
    try:
        return sim.run()
    finally:
        sim.close()


# --------------------------------------------------------------------------------------
# Raw signals: what each checklist item measures, computed from records and engine samples.
# --------------------------------------------------------------------------------------
