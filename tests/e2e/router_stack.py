"""The real-router stack the router e2e tests share: simulated workers, a real router in front of
them, and the exporter in-process with real scrapes and ZMQ subscriptions — and how to read it."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import Config, HttpRecords, OtlpTraces, RouterTarget, WorkerTarget
from exporter.main import Runtime
from fleet.engine import WorkerSpec
from fleet.worker_http import RequestCallback
from fleet.workers import FleetOptions, WorkerFleet
from prefixscope import catalog
from tests.e2e.routers import SMG, RouterProcess, start_router
from tests.support import require_peer_python, require_routers_bin, wait_for

P = catalog.NAMESPACE
MODEL = "sim-model"
TOKEN = "e2e-token"
CAPACITY_BLOCKS = 4096
SMG_VERSION = "1.13.0"  # the Makefile's SMG_VERSION
# exporter counter (without prefix and _total) → the simulated engine's own counter
COUNTERS = {"prefix_cache_hit_tokens": "prefix_hits", "prefix_cache_queried_tokens": "prefix_queries",
            "spec_decode_draft_tokens": "spec_draft_tokens", "spec_decode_accepted_tokens": "spec_accepted_tokens"}

# The signals each stack feeds with no request record posted: routers and workers alone, and the
# same with vLLM's spans, a GenAI client's spans and a topology file (docs/routers.md's columns).
FED_WITHOUT_RECORDS = frozenset({"worker_metrics", "kv_events", "kv_token_ids", "spec_decode", "router_metrics"})
FED_BY_SPANS_AND_TOPOLOGY = FED_WITHOUT_RECORDS | {"otlp_spans", "records", "session_key", "cached_tokens",
                                                   "prefill_timing", "migrations", "topology", "warm_pool",
                                                   "placements", "affinity_outcomes"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def exported(base_url: str) -> Samples:
    """Every sample on the exporter's /metrics, keyed by (name, sorted labels)."""
    text = requests.get(base_url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@dataclass
class Stack:
    kind: str
    fleet: WorkerFleet
    router: RouterProcess
    runtime: Runtime

    def samples(self) -> Samples:
        return exported(self.runtime.url)

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, tuple(sorted(labels.items()))))

    def names(self) -> set[str]:
        return {name for name, _ in self.samples()}

    def groups(self) -> dict:
        r = requests.get(self.runtime.url + "/api/v1/groups", timeout=5)
        assert r.status_code == 200, r.text
        return r.json()["data"]

    def checks(self) -> dict[str, dict]:
        return {c["key"]: c for st in self.groups()["steps"] for c in st["checks"]}


@dataclass(frozen=True)
class StackOptions:
    """What a test changes about the stack; the defaults are the plain router-and-workers one."""

    workers: int = 3
    otlp: OtlpTraces = field(default_factory=OtlpTraces)
    topology: Path | None = None
    window: float | None = None
    on_request: RequestCallback | None = None
    router_args: tuple[str, ...] = ()  # appended to the router's command line
    policy: str = "cache_aware"
    max_tree_size: int | None = None  # the router's --max-tree-size as the exporter's config states it
    track_placement: bool = False  # the fleet keeps where each request's longest prefix lived (fleet.workers.Placement)


def worker_specs(n: int) -> Sequence[WorkerSpec]:
    # decode 16 tokens at 50/s ≈ 0.3 s per request, so concurrent first requests spread out
    return [WorkerSpec(f"w{i}", decode_tps=50.0, spec_tokens=3, num_gpu_blocks=CAPACITY_BLOCKS) for i in range(n)]


@contextmanager
def open_stack(kind: str, log_dir: Path, options: StackOptions = StackOptions()) -> Iterator[Stack]:
    """Workers, the router ``kind`` in front of them (fast health checks) and the exporter, with
    a first scrape of every target taken before any traffic."""
    bin_dir = require_peer_python(f"smg-{SMG_VERSION}").parent if kind == SMG else require_routers_bin()
    adapter = "sglang-router" if kind == SMG else kind  # smg speaks the sglang-router adapter's names
    fleet = WorkerFleet(worker_specs(options.workers), options=FleetOptions(delay_scale=1.0),
                        on_request=options.on_request, track_placement=options.track_placement).start()
    router = runtime = None
    try:
        router = start_router(kind, bin_dir, fleet.urls, log_dir, policy=options.policy, health_interval_s=1,
                              extra_args=options.router_args)
        workers = tuple(WorkerTarget(e["name"], e["url"] + "/metrics", e["kv_endpoint"], e["replay_endpoint"],
                                     e["topic"]) for e in fleet.endpoints())
        cfg = Config(source="e2e", workers=workers, routers=(RouterTarget(kind, router.metrics_url, adapter, options.max_tree_size),),
                     scrape_interval=0.5, scrape_timeout=0.5, listen_address="127.0.0.1:0",
                     http_records=HttpRecords(bearer_token=TOKEN), otlp=options.otlp,
                     topology=options.topology, window=options.window)
        runtime = Runtime.build(cfg).start()
        assert runtime.subscriber is not None and runtime.subscriber.wait_connected(5)
        s = Stack(kind, fleet, router, runtime)
        # Counters enter the windows as increases from the first scrape: take it before any traffic.
        wait_for(lambda: all(s.value(f"{P}_up", target=t, kind=k) == 1.0
                             for t, k in [*((w.name, "worker") for w in fleet), (kind, "router")]),
                 "a first successful scrape of every target")
        time.sleep(0.3)  # ZMQ subscriptions reach the PUB sockets asynchronously
        yield s
    finally:
        if runtime is not None:
            runtime.stop()
        if router is not None:
            router.stop()
        fleet.stop()


def settle(s: Stack, bypassed: Mapping[str, int] | None = None) -> None:
    """Every live engine idle, every KV batch published, and a scrape taken after that.
    ``bypassed``: requests sent to a worker directly, not through the router (per worker)."""
    live = [w for w in s.fleet if w.alive]
    for w in live:
        wait_for(lambda w=w: w.engine.load() == (0, 0), f"{w.name} idle")
        w.engine.tick()
        w.publisher.flush(2.0)
    served = {w.name: sum(w.engine.counters.requests_success.values()) - (bypassed or {}).get(w.name, 0)
              for w in live}
    wait_for(lambda: all(s.value(f"{P}_router_decisions_total", router=s.kind, worker=n) == v
                         for n, v in served.items() if v),
             "router decisions to match the workers' served requests")

    def scraped_after_load() -> bool:
        got = s.samples()
        return all(got.get((f"{P}_{name}_total", (("model", MODEL), ("worker", w.name)))) == getattr(w.engine.counters, fld)
                   for w in live for name, fld in COUNTERS.items())

    wait_for(scraped_after_load, "a scrape after the load")
