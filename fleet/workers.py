"""WorkerFleet: N simulated workers on 127.0.0.1, each an engine + HTTP server + KV publisher.

Everything binds an ephemeral port. A worker can be killed (its HTTP server and ZMQ sockets go
away, as when a process dies) and restarted with a fresh engine: empty cache, counters from zero
and a KV-event sequence starting again at 0, which is how a subscriber recognises a restart. A
restart takes the worker's old ports back when it can (readers keep their URLs); when another
process took one of them meanwhile (ephemeral ports are anyone's once released), it retries
briefly and then binds fresh ports, so one worker's restart never takes the fleet down. Such a
move is counted in :attr:`WorkerFleet.moves` so whoever published the endpoints can publish them
again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq

from fleet.clock import Clock, RealClock
from fleet.engine import SimEngine, WorkerSpec
from fleet.kv_publisher import KvEventPublisher
from fleet.metrics_text import FLAVOURS
from fleet.worker_http import RequestCallback, WorkerServer

log = logging.getLogger("prefixscope.fleet.workers")

# A restart waits this long for its old ports before it binds fresh ones.
REBIND_ATTEMPTS = 20
REBIND_PAUSE_S = 0.05


@dataclass(slots=True)
class FleetOptions:
    flavour: str = "vllm"  # /metrics names: "vllm", "vllm-legacy" or "sglang"
    encoding: str = "array"  # KV events: "array" (vLLM ≤ 0.23) or "map" (≥ 0.24)
    hash_form: str = "int"  # KV-event hashes: "int" (u64) or "bytes"
    replay_shape: str = "0.26"  # replay reply frames: "0.26" or "0.25"
    topic: str = "kv@{name}@{model}"  # llm-d's topic convention; "" is vLLM's default
    delay_scale: float = 1.0  # real-clock responses wait modelled time × this
    tick_interval: float = 0.01  # how often due engine work is applied on the clock
    buffer_steps: int = 10000

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ValueError(f"unknown metrics flavour {self.flavour!r}; choose one of {', '.join(FLAVOURS)}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request's longest cached prefix lived when a worker admitted it: the leading blocks
    of its prompt each live worker's cache held (the fleet's own caches, not anyone's view of them)."""

    worker: str  # the worker that admitted it
    blocks: int  # full blocks of its prompt
    depths: dict[str, int]  # live worker -> leading blocks it held (0 included)

    @property
    def best(self) -> int:
        return max(self.depths.values(), default=0)

    @property
    def holders(self) -> frozenset[str]:
        """The workers holding the longest cached prefix (none when nothing was cached)."""
        best = self.best
        return frozenset(w for w, d in self.depths.items() if d == best > 0)

    @property
    def stores(self) -> bool:
        """It computes blocks its worker did not hold, so the worker publishes a BlockStored."""
        return self.depths.get(self.worker, 0) < self.blocks


@dataclass(slots=True)
class SimWorker:
    spec: WorkerSpec
    engine: SimEngine
    server: WorkerServer
    publisher: KvEventPublisher
    url: str
    kv_endpoint: str
    replay_endpoint: str | None
    alive: bool = True

    @property
    def name(self) -> str:
        return self.spec.name


class WorkerFleet:
    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        clock: Clock | None = None,
        options: FleetOptions | None = None,
        on_request: RequestCallback | None = None,
        track_placement: bool = False,
    ) -> None:
        """``track_placement``: keep a :class:`Placement` per admitted request (``placements``)."""
        self.specs = list(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("worker names must be unique")
        self.clock: Clock = clock or RealClock()
        self.options = options or FleetOptions()
        self.on_request = on_request
        self.workers: dict[str, SimWorker] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.moves = 0  # restarts that came back on fresh ports (the endpoints changed)
        self.track_placement = track_placement
        self.placements: dict[str, Placement] = {}  # request id -> where its prefix lived at admission

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> WorkerFleet:
        for spec in self.specs:
            self.workers[spec.name] = self._launch(spec, attempts=50)
        self._ticker = threading.Thread(target=self._tick_loop, name="fleet-ticker", daemon=True)
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(2)
        for w in list(self.workers.values()):
            if w.alive:
                self._shutdown(w)

    def __enter__(self) -> WorkerFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, spec: WorkerSpec, port: int = 0, kv: str | None = None,
                replay: str | None = None, attempts: int = 1) -> SimWorker:
        """Bind the worker's HTTP server and KV-event sockets (0 / None: ephemeral), retrying
        ``attempts`` times when an address is in use; raises :class:`OSError` or
        :class:`RuntimeError` when it still cannot bind."""
        engine = SimEngine(spec, self.clock)
        if self.track_placement:
            engine.on_admit = lambda rid, hashes: self._admitted(spec.name, rid, hashes)
        publisher = self._bind_publisher(spec, engine, kv, replay, attempts)
        engine.on_events = publisher.publish
        try:
            server = self._bind_server(engine, port, attempts)
        except OSError:
            publisher.close()
            raise
        return SimWorker(spec, engine, server.start(), publisher, server.url, publisher.endpoint,
                         publisher.replay_endpoint)

    def _bind_server(self, engine: SimEngine, port: int, attempts: int) -> WorkerServer:
        o = self.options
        for attempt in range(attempts):
            try:
                return WorkerServer(engine, o.flavour, port=port, delay_scale=o.delay_scale,
                                    on_request=self.on_request)
            except OSError:
                if attempt == attempts - 1:
                    raise
                time.sleep(REBIND_PAUSE_S)
        raise AssertionError("unreachable")

    def _bind_publisher(self, spec: WorkerSpec, engine: SimEngine, kv: str | None,
                        replay: str | None, attempts: int) -> KvEventPublisher:
        o = self.options
        last: Exception | None = None
        for _ in range(attempts):
            try:
                return KvEventPublisher(
                    endpoint=kv or "tcp://127.0.0.1:0",
                    replay_endpoint=replay or "tcp://127.0.0.1:0",
                    topic=o.topic.format(name=spec.name, model=spec.model),
                    encoding=o.encoding, hash_form=o.hash_form, replay_shape=o.replay_shape,
                    buffer_steps=o.buffer_steps,
                    drop_share=lambda: engine.knobs.drop_kv_events, seed=spec.seed,
                )
            except (RuntimeError, zmq.ZMQError) as e:
                last = e
                time.sleep(REBIND_PAUSE_S)
        raise RuntimeError(f"cannot bind the KV-event sockets of {spec.name}: {last}")

    def _shutdown(self, w: SimWorker) -> None:
        w.alive = False
        w.server.stop()
        w.publisher.flush(1.0)
        w.publisher.close()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.options.tick_interval):
            for w in list(self.workers.values()):
                if w.alive:
                    w.engine.tick()

    def _admitted(self, worker: str, request_id: str, hashes: Sequence[int]) -> None:
        """Ground truth for topology-aware placement, at admission (under the admitting engine's
        lock): every live worker's cache as it stands, read without the other engines' locks (a
        dict lookup per block; a concurrent commit elsewhere lands before or after, never half)."""
        depths = {w.name: w.engine.cache.match(hashes) for w in list(self.workers.values()) if w.alive}
        depths.setdefault(worker, 0)
        self.placements[request_id] = Placement(worker, len(hashes), depths)

    # -- faults ---------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """The worker process dies: HTTP and ZMQ endpoints go away, in-flight work is lost."""
        with self._lock:
            w = self.workers[name]
            if w.alive:
                self._shutdown(w)

    def restart(self, name: str) -> SimWorker:
        """Start the worker again with a fresh engine (empty cache, seq 0): on its old ports when
        they can be bound again within about a second, else on fresh ports (``moves`` counts it)."""
        with self._lock:
            old = self.workers[name]
            if old.alive:
                self._shutdown(old)
            try:
                w = self._launch(old.spec, port=old.server.port, kv=old.kv_endpoint, replay=old.replay_endpoint,
                                 attempts=REBIND_ATTEMPTS)
            except (OSError, RuntimeError) as exc:
                w = self._launch(old.spec)
                self.moves += 1
                log.warning("worker %s: its old ports are taken (%s); it restarted on %s, kv=%s, replay=%s",
                            name, exc, w.url, w.kv_endpoint, w.replay_endpoint)
            self.workers[name] = w
            return w

    # -- views ----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> SimWorker:
        return self.workers[name]

    def __iter__(self):
        return iter(list(self.workers.values()))

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers.values()]

    def endpoints(self) -> list[dict[str, str | None]]:
        """Per worker: name, HTTP base URL, KV-event PUB endpoint, replay endpoint, topic."""
        return [{"name": w.name, "url": w.url, "kv_endpoint": w.kv_endpoint, "replay_endpoint": w.replay_endpoint,
                 "topic": w.publisher.topic.decode(), "model": w.spec.model} for w in self.workers.values()]
