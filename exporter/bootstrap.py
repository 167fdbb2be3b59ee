"""The composition root: the one place that builds the exporter's parts.

Everything that holds an exporter — the ``prefixscope export`` process, the what-if replay, the
scenario harness, the benchmarks — asks :func:`bootstrap` for its parts instead of wiring
``Health``, ``ClusterState`` and the collector by hand, so a new collaborator of the state (or a
new default) is added here once. Parts come from a config file's settings, from explicit
arguments, or both (an explicit argument wins):

- thresholds: ``thresholds=`` › ``cfg.thresholds`` › the packaged alerts/thresholds.yaml;
- topology: ``topology=`` › ``cfg.topology`` › none;
- window: ``window_s=`` › ``cfg.window`` › the thresholds' rate window;
- clock: ``clock=`` (``time.time`` for a live exporter, a virtual clock for simulations).

Every part is built before the part that uses it and handed in (``exporter.core.state_parts``):
what only this root knows reaches the state as a constructor argument — the KV source's rebuild
requests (``exporter.model.RebuildRequests``, handed to both), a shard's shared root tracker, the
workers the config names (never folded into "other"), a replay's run-long window — and nothing
is set on a part after it was built.

The parts include the breach record and the loop that advances it on that clock every
``cfg.breach_interval`` (``exporter.loops.breach_loop``): created, not started — the runtime starts
and stops it with its other threads; a caller that drives time itself calls ``evaluate_once``.

The parts that do the exporter's work (the breach loop, and with ``with_sources`` the scraper
and the KV sources) charge it to one duty clock (``exporter.loops.duty_clock``): the caller's
``duties=``, or a fresh one in ``parts.duties``.

With ``with_sources=True`` the config's inputs are built too (KV-event subscriber, NATS source,
record-file tailers, scraper) — created, not started. A sharded config (``shard``) scrapes and
subscribes over ZMQ only its home workers and reads every worker's NATS subject through the
family filter (``exporter.core.sharding``), keeping only the request records it owns; routers are
scraped by shard 0 alone. A problem with a referenced file is a ConfigError.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from exporter.codecs.normalize import worker_names_by_url
from exporter.config import Config, ConfigError, WorkerTarget, load_fleet_manifest
from exporter.core.breaches import BreachClock
from exporter.core.health import Health
from exporter.core.prefix_text import Detokenizer, PrefixNames, PrefixTokens, TokenTee
from exporter.core.sharding import (
    RecordSink,
    ShardRecords,
    ShardSink,
    ShardSpec,
    SharedRoots,
    home_shard,
)
from exporter.core.state import ClusterState
from exporter.core.state_parts import build_parts
from exporter.loops.breach_loop import BreachLoop
from exporter.loops.duty_clock import DutyClock
from exporter.model import KvSink, RebuildRequests, StateSink
from exporter.sources.kv_nats import NatsKvSettings, NatsKvSource
from exporter.sources.kv_zmq import KvEndpoint, KvEventSubscriber
from exporter.sources.records import RecordFileTail
from exporter.sources.scrape import Scraper, ScrapeTarget
from exporter.web.collector import PrefixscopeCollector
from prefixscope.thresholds import ConfigError as ThresholdsError
from prefixscope.thresholds import Thresholds, load_thresholds, window_seconds
from prefixscope.topology import Topology, TopologyError, load_topology

Clock = Callable[[], float]


@dataclass(frozen=True)
class Sources:
    """The config's inputs, created but not started."""

    workers: tuple[WorkerTarget, ...]
    subscriber: KvEventSubscriber | None  # None when no worker publishes KV events
    tails: list[RecordFileTail]
    scraper: Scraper
    names: PrefixNames | None = None  # hot branches' text; None unless the config turns it on
    nats: NatsKvSource | None = None  # None when no KV events come over NATS
    # where request records go: the state, or (sharded) the filter keeping this shard's records
    records: RecordSink | None = None


@dataclass(frozen=True)
class ExporterParts:
    health: Health
    state: ClusterState
    collector: PrefixscopeCollector
    thresholds: Thresholds
    topology: Topology | None
    window_s: float
    clock: Clock
    breaches: BreachClock  # when each check began breaching (the API reads it)
    breach_loop: BreachLoop  # advances ``breaches`` in the background (not started)
    sources: Sources | None = None  # only with ``with_sources=True``
    duties: DutyClock = field(default_factory=DutyClock)  # the loop's and the sources' CPU per duty


def bootstrap(cfg: Config | None = None, *, thresholds: Thresholds | None = None,
              topology: Topology | None = None, window_s: float | None = None, clock: Clock = time.time,
              with_sources: bool = False, duties: DutyClock | None = None, run_window: bool = False) -> ExporterParts:
    """Build health, state (thresholds, topology, window, clock), collector and breach record (with
    its loop, unstarted), and optionally the sources. ``run_window``: the state's reads cover the
    whole run so far, not the last window (a replay's answer for its trace).

    Raises ConfigError when the config names a thresholds or topology file that cannot be used.
    """
    cfg = cfg if cfg is not None else Config()
    if thresholds is None:
        try:
            thresholds = load_thresholds(cfg.thresholds)
        except ThresholdsError as exc:
            raise ConfigError(f"{cfg.source}: thresholds: {exc}") from None
    if topology is None and cfg.topology is not None:
        try:
            topology = load_topology(cfg.topology)
        except (TopologyError, OSError) as exc:
            raise ConfigError(f"{cfg.source}: topology: {exc}") from None
    if window_s is None:
        window_s = cfg.window if cfg.window is not None else window_seconds(thresholds)

    duties = duties or DutyClock()
    health = Health()
    workers = configured_workers(cfg) if with_sources else ()
    endpoints = kv_endpoints(cfg, workers)
    # where the state sends a drifted view to be rebuilt; the ZMQ subscriber takes the requests
    # (a live exporter always has one: workers that discovery or a reload adds may have a replay)
    rebuilds = RebuildRequests(w for w, ep in endpoints.items() if ep.replay) if with_sources else None
    spec = ShardSpec(cfg.shard.index, cfg.shard.count)
    # a shard reading NATS judges prefix instability over every shard's roots (its sink feeds them)
    roots = SharedRoots(window_s) if spec.sharded and cfg.kv_nats is not None else None
    state = ClusterState(build_parts(health, thresholds, topology, window_s=window_s, clock=clock, limits=cfg.limits,
                                     eviction_memory=cfg.eviction_memory, roots=roots, rebuild_request=rebuilds,
                                     pinned_workers=(w.name for w in workers), run_window=run_window,
                                     down_grace_s=cfg.worker_down_grace if with_sources else math.inf,
                                     shard=spec))
    breaches = BreachClock()
    parts = ExporterParts(health=health, state=state, collector=PrefixscopeCollector(state, health),
                          thresholds=thresholds, topology=topology, window_s=window_s, clock=clock,
                          breaches=breaches, breach_loop=BreachLoop(state, breaches, cfg.breach_interval, duties),
                          duties=duties)
    if not with_sources:
        return parts
    return replace(parts, sources=_build_sources(cfg, state, health, clock, duties, workers, endpoints, rebuilds))


def _build_sources(cfg: Config, state: ClusterState, health: Health, clock: Clock, duties: DutyClock,
                   workers: tuple[WorkerTarget, ...], endpoints: dict[str, KvEndpoint],
                   rebuilds: RebuildRequests | None) -> Sources:
    """The config's workers, routers and record files as (unstarted) inputs feeding ``state``."""
    spec = ShardSpec(cfg.shard.index, cfg.shard.count)
    texts = prefix_names(cfg, workers) if cfg.prefix_text else None
    sink: StateSink = TokenTee(state, texts.tokens) if texts is not None else state
    # With service discovery a subscriber runs even before any worker publishes: workers join it.
    subscriber = kv_subscriber(cfg, endpoints, sink, health, clock, duties, texts is not None, rebuilds) \
        if endpoints or cfg.discovery else None
    records: RecordSink = ShardRecords(state, spec) if spec.sharded else state
    tails = [RecordFileTail(p, records, health, clock=clock, ts_tolerance_s=cfg.file_records.ts_tolerance_s)
             for p in cfg.file_records.paths]
    scraper = Scraper(scrape_targets(cfg, workers), state, health, timeout=cfg.scrape_timeout,
                      interval=cfg.scrape_interval, clock=clock, duties=duties)
    return Sources(workers=workers, subscriber=subscriber, tails=tails, scraper=scraper, names=texts,
                   nats=build_nats_source(cfg, workers, state, health, clock, duties), records=records)


def _home(cfg: Config, workers: tuple[WorkerTarget, ...]) -> list[WorkerTarget]:
    """The workers this shard scrapes and subscribes to over ZMQ (all of them unsharded)."""
    spec = ShardSpec(cfg.shard.index, cfg.shard.count)
    return [w for w in workers if home_shard(w.name, spec.count) == spec.index]


def kv_endpoints(cfg: Config, workers: tuple[WorkerTarget, ...]) -> dict[str, KvEndpoint]:
    """The ZMQ KV-event endpoints this exporter follows, by worker."""
    return {w.name: KvEndpoint(w.kv_events, w.replay, w.topic) for w in _home(cfg, workers)
            if w.kv_events and not _is_nats(w.kv_events)}


def kv_subscriber(cfg: Config, endpoints: dict[str, KvEndpoint], sink: StateSink, health: Health,
                  clock: Clock = time.time, duties: DutyClock | None = None,
                  token_ids: bool = False, rebuilds: RebuildRequests | None = None) -> KvEventSubscriber:
    return KvEventSubscriber(endpoints, sink, health, clock=clock, token_ids=token_ids,
                             attribution=cfg.attribution, duties=duties, rebuilds=rebuilds)


def scrape_targets(cfg: Config, workers: tuple[WorkerTarget, ...]) -> list[ScrapeTarget]:
    """This exporter's scrape targets: its home workers, and (shard 0) the routers, which learn
    each worker's name by its URL."""
    targets = [ScrapeTarget(w.name, w.metrics_url, "worker") for w in _home(cfg, workers) if w.metrics_url]
    names = tuple(worker_names_by_url((w.name, w.metrics_url) for w in workers if w.metrics_url).items())
    if cfg.shard.index == 0:
        targets += [ScrapeTarget(r.name, r.metrics_url, "router", r.kind, names, r.max_tree_size) for r in cfg.routers]
    return targets


def prefix_names(cfg: Config, workers: tuple[WorkerTarget, ...]) -> PrefixNames:
    """Prefix text for the config's workers: each is asked at its HTTP base (its metrics URL's)."""
    urls = {w.name: w.metrics_url.removesuffix("/metrics") for w in workers if w.metrics_url}
    return PrefixNames(PrefixTokens(), Detokenizer(), urls)


def _is_nats(endpoint: str) -> bool:
    return endpoint.startswith(("nats://", "tls://"))


def build_nats_source(cfg: Config, workers: tuple[WorkerTarget, ...], state: KvSink, health: Health,
                      clock: Clock = time.time, duties: DutyClock | None = None) -> NatsKvSource | None:
    """The NATS source of ``cfg.kv_nats`` (None without one), behind the family filter when sharded
    (``state``: built by :func:`bootstrap` for ``cfg``, so a shard's root tracker is the shared one)."""
    n = cfg.kv_nats
    if n is None:
        return None
    spec = ShardSpec(cfg.shard.index, cfg.shard.count)
    named = frozenset(w.name for w in workers if w.kv_events and _is_nats(w.kv_events))
    relay = n.all_workers or bool(named)
    durable = n.durable or ("prefixscope-export" + (f"-shard{spec.index}" if spec.sharded else ""))
    settings = NatsKvSettings(url=n.url, stream=n.stream, subject_prefix=n.subject_prefix,
                              workers=None if n.all_workers else named, durable=durable, relay=relay,
                              dynamo_subjects=n.dynamo_subjects, dynamo_block_size=n.dynamo_block_size,
                              attribution=cfg.attribution)
    if not spec.sharded:
        return NatsKvSource(settings, state, health, clock=clock, duties=duties)
    shard = family_sink(state, spec, health)
    return NatsKvSource(settings, shard, health, clock=clock, home=shard.home, duties=duties)


def family_sink(state: KvSink, spec: ShardSpec, health: Health) -> ShardSink:
    """The family filter in front of a shard's state: a ClusterState is given every root branch
    (through its shared root tracker, if it was built with one) and every batch, its stream health
    left to home shards; a bare KV sink (tests) is given whole batches."""
    if not isinstance(state, ClusterState):
        return ShardSink(state, spec, health=health)
    roots = state.kv.roots
    return ShardSink(state, spec, health=health, roots=roots if isinstance(roots, SharedRoots) else None,
                     stream_aware=True, attribution=state.attribution.kv)


def configured_workers(cfg: Config) -> tuple[WorkerTarget, ...]:
    """The config's workers plus the fleet manifest's (a name in the config wins)."""
    if cfg.fleet_manifest is None:
        return cfg.workers
    names = {w.name for w in cfg.workers}
    return cfg.workers + tuple(w for w in load_fleet_manifest(cfg.fleet_manifest, cfg.source) if w.name not in names)
