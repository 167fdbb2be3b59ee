"""A running exporter following its fleet and its config, without a restart and without losing state.

:class:`FleetFollower` applies a set of workers to the running parts: the scraper's targets, the
KV-event subscriber's endpoints, the state (a worker that went leaves the pool and the index at
once and is never a blind target; a new one keeps its own series), and the topology placement
is judged by: the topology file's workers plus those whose discovered labels place them
(``prefixscope.topology.with_discovered``: the file's entry wins for a worker it names), so a
worker that leaves leaves the topology too. Service discovery
(``exporter.sources.discovery``) calls it whenever the fleet changes; so does a reload.

:class:`ConfigReloader` reloads the config file (SIGHUP, ``POST /-/reload``, a watched change):
a file that does not validate keeps the running configuration and says why
(``prefixscope_config_last_reload_successful`` 0). What a reload applies: the workers, the fleet
manifest, the routers, service discovery, the scrape interval and timeout, and
``worker_down_grace`` (and, with the workers, the placement their discovered labels give). Everything
else (the listen address, thresholds, the topology file, windows, limits, transports, shard) is read at start: a change is logged as needing a restart and the running
value stays. The prefix index, the windows and the breach records are never rebuilt: they live in
the state, which a reload does not touch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace

from exporter.bootstrap import configured_workers, kv_endpoints, kv_subscriber, scrape_targets
from exporter.config import Config, ConfigError, WorkerTarget, check_intake_auth
from exporter.core.health import Health
from exporter.core.prefix_text import PrefixNames, TokenTee
from exporter.core.state import ClusterState
from exporter.loops.duty_clock import DutyClock
from exporter.model import RebuildRequests, StateSink
from exporter.sources.discovery.manager import SOURCE, Discovery
from exporter.sources.kv_zmq import KvEventSubscriber
from exporter.sources.scrape import Scraper
from prefixscope.topology import with_discovered

log = logging.getLogger("prefixscope.reload")

RELOAD_OK = "prefixscope_config_last_reload_successful"
RELOAD_TS = "prefixscope_config_last_reload_success_timestamp_seconds"
# What a reload applies; every other field is read at start.
RELOADABLE = frozenset({"source", "workers", "fleet_manifest", "routers", "discovery", "scrape_interval",
                        "scrape_timeout", "worker_down_grace", "log_level"})


class FleetFollower:
    """Applies worker sets to a running exporter (any thread; one change at a time)."""

    def __init__(self, cfg: Config, workers: tuple[WorkerTarget, ...], state: ClusterState, health: Health,
                 scraper: Scraper, subscriber: KvEventSubscriber | None, names: PrefixNames | None = None,
                 clock: Callable[[], float] = time.time, duties: DutyClock | None = None) -> None:
        self.cfg = cfg
        self.workers = workers
        self.state = state
        self.health = health
        self.scraper = scraper
        self.subscriber = subscriber
        self.names = names
        self.clock = clock
        self.duties = duties
        self.lock = threading.RLock()
        self.started_subscriber: KvEventSubscriber | None = None  # one this follower had to start
        self.applied = False  # the first set applied is the fleet at start: its workers join unannounced
        self.file_topology = state.topology  # the topology file's (read at start, never reloaded)

    def apply(self, workers: tuple[WorkerTarget, ...], cfg: Config | None = None) -> tuple[list[str], list[str]]:
        """Follow ``workers`` from now on; returns (joined, left). A worker whose endpoints changed
        under the same name left and joined again (a restart elsewhere: its cache is new)."""
        with self.lock:
            cfg = cfg or self.cfg
            old = {w.name: w.endpoints() for w in self.workers}
            new = {w.name: w.endpoints() for w in workers}  # a topology label changing is no new worker
            left = [n for n, w in old.items() if new.get(n) != w]
            joined = [n for n, w in new.items() if old.get(n) != w]
            self.scraper.set_targets(scrape_targets(cfg, workers))
            endpoints = kv_endpoints(cfg, workers)
            if self.subscriber is None and endpoints:
                self.subscriber = self._start_subscriber(cfg)
            if self.subscriber is not None:
                self.subscriber.update_endpoints(endpoints)
            self.state.membership.left(left)
            before = set(self.workers)
            self._place(workers, changed={w.name for w in workers if w not in before})
            self.state.membership.joined(joined, announced=self.applied)
            self.applied = True
            if self.names is not None:
                self.names.worker_urls.update({w.name: w.metrics_url.removesuffix("/metrics")
                                        for w in workers if w.metrics_url})
            self.cfg, self.workers = cfg, workers
        if joined or left:
            log.info("fleet: %d worker(s)%s%s", len(workers), f", joined {', '.join(sorted(joined))}" if joined else "",
                     f", left {', '.join(sorted(left))}" if left else "")
        return joined, left

    def _place(self, workers: tuple[WorkerTarget, ...], changed: set[str]) -> None:
        """The topology file's workers and those the discovered labels place; a worker whose labels
        cannot place it (``changed``: found or relabelled now) is counted once and left unplaced."""
        topology, problems = with_discovered(self.file_topology, {w.name: dict(w.topology) for w in workers})
        for name, problem in problems.items():
            if name in changed:
                self.health.error(SOURCE, "topology", f"worker {name}: {problem}")
        self.state.set_topology(topology)

    def _start_subscriber(self, cfg: Config) -> KvEventSubscriber:
        """A KV-event subscriber for an exporter that started without one (no worker published)."""
        sink: StateSink = TokenTee(self.state, self.names.tokens) if self.names is not None else self.state
        rebuilds = self.state.kv.rebuild_request  # the state's requests, made with it by bootstrap
        sub = kv_subscriber(cfg, {}, sink, self.health, self.clock, self.duties, self.names is not None,
                            rebuilds if isinstance(rebuilds, RebuildRequests) else None)
        sub.start()
        self.started_subscriber = sub
        return sub

    def close(self) -> None:
        if self.started_subscriber is not None:
            self.started_subscriber.close(timeout=2.0)


class ConfigReloader:
    """Reloads the config through ``load`` (the file plus the command line's flags)."""

    def __init__(self, cfg: Config, load: Callable[[], Config], follower: FleetFollower, health: Health,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.load = load
        self.follower = follower
        self.health = health
        self.clock = clock
        self.discovery: Discovery | None = None
        self._lock = threading.Lock()
        self.health.set(RELOAD_OK, (), 1.0)
        self.health.set(RELOAD_TS, (), clock())

    # ---- discovery ------------------------------------------------------------------------
    def start_discovery(self) -> None:
        """Follow the config's service discovery (or, without any, its static workers)."""
        cfg = self.cfg
        static = configured_workers(cfg)
        if not cfg.discovery:
            self.follower.apply(static, cfg)
            return
        self.discovery = Discovery(cfg.discovery, static, lambda ws: self.follower.apply(ws, self.cfg),
                                   self.health, clock=self.clock).start()

    def close(self) -> None:
        if self.discovery is not None:
            self.discovery.close()

    # ---- reload ---------------------------------------------------------------------------
    def reload(self) -> tuple[bool, str]:
        """Load the config again and apply what can change live; (ok, what happened)."""
        with self._lock:
            try:
                new = self.load()
                check_intake_auth(new)
                configured_workers(new)  # the fleet manifest must read, too
            except ConfigError as exc:
                self.health.set(RELOAD_OK, (), 0.0)
                log.error("config reload failed, the running configuration is kept: %s", exc)
                return False, str(exc)
            old = self.cfg
            pending = [f.name for f in fields(Config)
                       if f.name not in RELOADABLE and getattr(new, f.name) != getattr(old, f.name)]
            applied = replace(new, **{name: getattr(old, name) for name in pending})
            if pending:
                log.warning("config reload: %s changed; a restart applies that (the running value is kept)",
                            ", ".join(pending))
            if applied.log_level != old.log_level:
                logging.getLogger().setLevel(applied.log_level.upper())
            scraper = self.follower.scraper
            scraper.interval, scraper.timeout = applied.scrape_interval, applied.scrape_timeout
            self.follower.state.worker_pool.down_grace_s = applied.worker_down_grace
            if self.discovery is not None:
                self.discovery.close()
                self.discovery.forget_series()
                self.discovery = None
            self.cfg = applied
            self.start_discovery()
            self.health.set(RELOAD_OK, (), 1.0)
            self.health.set(RELOAD_TS, (), self.clock())
            message = "reloaded" + (f"; needs a restart to apply: {', '.join(pending)}" if pending else "")
            log.info("config %s", message)
            return True, message
