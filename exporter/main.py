"""``prefixscope export``: wire the sources, the cluster state and the HTTP server together.

The parts themselves (health, state, collector, sources) come from :mod:`exporter.bootstrap`;
this module adds the HTTP server, the tree-statistics refresher and the process lifecycle.

Flags follow the Go exporters (``--config.file``, ``--web.listen-address``, ``--log.level``) and
override the config file. A bad config or flag prints one clear line and exits 2, never a
traceback. SIGTERM and SIGINT stop every thread within a second or two. SIGHUP and
``POST /-/reload`` reload the config file (``exporter.follow``: an invalid file keeps the running
configuration); ``--config.auto-reload-interval`` also reloads it when its content changes.

Threads: one scrape loop (every ``scrape_interval``; /metrics never triggers a scrape, it
renders the latest state), one KV-event subscriber for all workers, one tailer per record
file, one tree-statistics refresher (every ``tree_stats_interval`` when the index changed;
/metrics never runs a statistics pass either), one breach loop (checks evaluated every
``breach_interval`` to record when each breach began; /api/v1/groups reads that record), and
the HTTP server's request threads.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry

from exporter import allocator
from exporter.bootstrap import bootstrap
from exporter.config import (
    DEFAULT_LISTEN,
    LOG_LEVELS,
    Config,
    ConfigError,
    WorkerTarget,
    check_intake_auth,
    load_config,
    parse_listen_address,
)
from exporter.core.breaches import BreachClock
from exporter.core.health import Health
from exporter.core.prefix_text import PrefixNames
from exporter.core.state import ClusterState
from exporter.follow import ConfigReloader, FleetFollower
from exporter.loops.breach_loop import BreachLoop
from exporter.loops.duty_clock import DutyClock
from exporter.loops.state_file import StateFile
from exporter.loops.tree_refresher import TreeStatsRefresher
from exporter.sources.kv_nats import NatsKvSource
from exporter.sources.kv_zmq import KvEventSubscriber
from exporter.sources.otlp_spans import SpanIntake
from exporter.sources.records import MAX_ERRORS_REPORTED, RecordFileTail, deliver, parse_ndjson
from exporter.sources.scrape import Scraper
from exporter.web import otlp_http
from exporter.web.api import ApiBuilders
from exporter.web.exposition import render_state
from exporter.web.otlp_grpc import GrpcTraceReceiver
from exporter.web.process_metrics import SelfMetrics
from exporter.web.server import ExporterServer, IntakeResult, ServerDeps, TargetStatus
from prefixscope import __version__
from prefixscope.durations import seconds
from prefixscope.units import format_duration

log = logging.getLogger("prefixscope.export")

STALLED_AFTER_INTERVALS = 3  # /healthz turns 503 when the scrape loop is this many intervals late
STATE_LOCK_WAIT_S = 2.0  # ... or when the state stays locked this long (ingest slices take milliseconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixscope export",
        description="Prometheus exporter for prefix-cache locality: scrapes worker and router /metrics, "
                    "subscribes to vLLM KV-cache events, takes request records, and serves /metrics and /api/v1.",
    )
    parser.add_argument("--config.file", dest="config_file", metavar="FILE",
                        help="YAML config (see docs/exporter.md); without it only record intake over HTTP runs")
    parser.add_argument("--web.listen-address", dest="listen_address", metavar="HOST:PORT",
                        help=f"address to serve /metrics and /api/v1 on (default {DEFAULT_LISTEN}; port 0 picks a free one)")
    parser.add_argument("--log.level", dest="log_level", choices=LOG_LEVELS, help="log level (default info)")
    parser.add_argument("--config.auto-reload-interval", dest="auto_reload", metavar="DURATION", default="0s",
                        help="check the config file this often and reload it when its content changed "
                             "(default 0s: only on SIGHUP or POST /-/reload)")
    parser.add_argument("--version", action="version", version=f"prefixscope {__version__}")
    return parser


def resolve_config(argv: list[str]) -> Config:
    """Flags + file → one validated Config; every problem is a ConfigError."""
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config_file) if args.config_file else Config()
    cfg = cfg.with_overrides(listen_address=args.listen_address, log_level=args.log_level)
    try:
        parse_listen_address(cfg.listen_address)
    except ValueError as exc:
        raise ConfigError(f"--web.listen-address: {exc}") from None
    check_intake_auth(cfg)
    return cfg


class Runtime:
    """Every moving part of one exporter process; ``build`` → ``start`` → ``stop``."""

    def __init__(self, cfg: Config, workers: tuple[WorkerTarget, ...], health: Health, state: ClusterState,
                 server: ExporterServer, subscriber: KvEventSubscriber | None, tails: list[RecordFileTail],
                 scraper: Scraper, clock: Callable[[], float], refresher: TreeStatsRefresher | None = None,
                 breach_loop: BreachLoop | None = None, duties: DutyClock | None = None) -> None:
        self.cfg = cfg
        self.duties = duties or DutyClock()  # what each duty costs (its threads' CPU), on /metrics
        self.workers = workers
        self.health = health
        self.state = state
        self.server = server
        self.subscriber = subscriber
        self.tails = tails
        self.scraper = scraper
        self.clock = clock
        self.refresher = refresher or TreeStatsRefresher(state, cfg.tree_stats_interval, self.duties)
        self.breach_loop = breach_loop or BreachLoop(state, BreachClock(), cfg.breach_interval, self.duties)
        self.names: PrefixNames | None = None  # hot branches' text (config prefix_text)
        self.state_file: StateFile | None = None  # config state_file: history and names across restarts
        self.spans: SpanIntake | None = None  # the OTLP trace receivers' intake, when either is on
        self.grpc: GrpcTraceReceiver | None = None  # OTLP/gRPC TraceService/Export (otlp.grpc_listen_address)
        self.nats: NatsKvSource | None = None  # KV events over NATS (set by build)
        self.follower: FleetFollower | None = None  # applies worker sets (discovery, reloads); set by build
        self.reloader: ConfigReloader | None = None
        self.started_at = clock()
        self.started_mono = time.monotonic()

    @property
    def url(self) -> str:
        return self.server.url

    # ---- assembly -------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: Config, clock: Callable[[], float] = time.time,
              load: Callable[[], Config] | None = None) -> Runtime:
        """Load thresholds, topology and manifest, and create (not start) every part. ``load``
        reads the config again for a reload (without it a reload re-applies ``cfg``).

        Raises ConfigError for any invalid referenced file, OSError if the address is taken.
        """
        check_intake_auth(cfg)
        duties = DutyClock()
        parts = bootstrap(cfg, clock=clock, with_sources=True, duties=duties)
        assert parts.sources is not None
        health, state, sources = parts.health, parts.state, parts.sources
        own = SelfMetrics(duties)  # process_*, python_gc_*, prefixscope_exporter_duty_*
        registry = CollectorRegistry(auto_describe=False)
        registry.register(parts.collector)
        registry.register(own)
        api = ApiBuilders(state, names=sources.names, breaches=parts.breaches,
                          shard=(cfg.shard.index, cfg.shard.count))
        records_sink = sources.records or state  # sharded: only the records this shard owns

        def ingest(body: bytes) -> IntakeResult:
            now = clock()  # the exporter's clock: a record's ts is checked against it
            records, errors = parse_ndjson(body, cfg.http_records.max_body_bytes, now=now,
                                           ts_tolerance_s=cfg.http_records.ts_tolerance_s)
            deliver(records, errors, records_sink, health, "http", now)
            return IntakeResult(len(records), len(errors), [e.as_dict() for e in errors[:MAX_ERRORS_REPORTED]])

        host, port = parse_listen_address(cfg.listen_address)
        runtime: Runtime  # the closures below read it once it exists

        def target_status() -> list[TargetStatus]:
            return runtime.target_status()

        def healthz() -> tuple[bool, dict[str, Any]]:
            return runtime.healthz()

        spans = SpanIntake(otlp_http.mapping_for(cfg.otlp, sources.workers), records_sink, health, is_healthy=state.worker_pool.is_healthy,
                           session_wait_s=cfg.otlp.session_wait, max_body_bytes=cfg.http_records.max_body_bytes,
                           clock=clock, duties=duties, ts_tolerance_s=cfg.http_records.ts_tolerance_s)
        endpoints_auth = otlp_http.bearer_check(cfg.http_records.bearer_token)

        deps = ServerDeps(
            registry=registry,
            api=api.routes(),
            ingest_ndjson=ingest if cfg.http_records.enabled else None,
            bearer_token=cfg.http_records.bearer_token,
            max_body_bytes=cfg.http_records.max_body_bytes,
            targets=target_status,
            healthz=healthz,
            render_text=lambda: render_state(state) + own.render_text(),
            ingest_traces=otlp_http.handler(spans, endpoints_auth) if cfg.otlp.enabled else None,
            reload=(lambda: runtime.reload()) if cfg.web.reload else None,
            max_connections=cfg.web.max_connections,
            read_timeout=cfg.web.read_timeout,
            duties=duties,
        )
        server = ExporterServer(host, port, deps)
        grpc_receiver = None
        if cfg.otlp.grpc_listen_address is not None:
            try:
                grpc_receiver = GrpcTraceReceiver(spans, cfg.otlp.grpc_listen_address, cfg.http_records.bearer_token,
                                                  receive_timeout=cfg.web.read_timeout)
            except OSError as exc:
                server.httpd.server_close()  # the HTTP port was bound already
                raise ConfigError(f"{cfg.source}: otlp.grpc_listen_address: {exc}") from None
        runtime = cls(cfg, sources.workers, health, state, server, sources.subscriber, sources.tails,
                      sources.scraper, clock, breach_loop=parts.breach_loop, duties=duties)
        runtime.names = sources.names
        if cfg.state_file is not None:  # read before any input: the saved history goes first
            runtime.state_file = StateFile(cfg.state_file, state, sources.names, cfg.state_interval)
            runtime.state_file.load()
        runtime.spans = spans if cfg.otlp.enabled or grpc_receiver is not None else None
        runtime.grpc = grpc_receiver
        runtime.nats = sources.nats
        runtime.follower = FleetFollower(cfg, sources.workers, state, health, sources.scraper, sources.subscriber,
                                         sources.names, clock, duties)
        runtime.reloader = ConfigReloader(cfg, load or (lambda: cfg), runtime.follower, health, clock)
        return runtime

    def reload(self) -> tuple[bool, str]:
        """Reload the config file (SIGHUP, POST /-/reload): (ok, what happened)."""
        assert self.reloader is not None
        ok, message = self.reloader.reload()
        self.cfg = self.reloader.cfg
        return ok, message

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Runtime:
        cfg = self.cfg
        for w in self.workers:
            log.info("worker %s: metrics %s, kv events %s, replay %s%s", w.name, w.metrics_url or "-",
                     w.kv_events or "-", w.replay or "-", " (optional)" if w.optional else "")
        for r in cfg.routers:
            log.info("router %s (%s): metrics %s", r.name, r.kind, r.metrics_url)
        for p in cfg.file_records.paths:
            log.info("records: tailing %s", p)
        if cfg.http_records.enabled:
            auth = "bearer token required" if cfg.http_records.bearer_token else "no token"
            log.info("records: POST /api/v1/records (%s, limit %d bytes)", auth, cfg.http_records.max_body_bytes)
        if self.subscriber is not None:
            self.subscriber.start()
        if self.nats is not None:
            self.nats.start()
        for tail in self.tails:
            tail.start()
        if self.reloader is not None:  # discovery's first round: the scraper's first one sees its workers
            self.reloader.start_discovery()
        if self.spans is not None:
            if cfg.otlp.enabled:
                log.info("traces: POST /v1/traces (OTLP/HTTP protobuf or JSON; session attributes: %s)",
                         ", ".join(cfg.otlp.session_attributes) or "none")
            if self.grpc is not None:
                log.info("traces: OTLP/gRPC TraceService/Export on %s", self.grpc.address)
            self.spans.start()
            if self.grpc is not None:
                self.grpc.start()
        self.scraper.start()
        self.refresher.start()
        self.breach_loop.start()
        if self.names is not None:
            self.names.detokenizer.start()
        if self.state_file is not None:
            self.state_file.start()
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop every thread; each part gets a bounded join so shutdown stays within seconds."""
        self.server.stop()
        if self.reloader is not None:
            self.reloader.close()
        if self.follower is not None:
            self.follower.close()
        if self.grpc is not None:
            self.grpc.stop(grace=1.0)
        if self.subscriber is not None:
            self.subscriber.close(timeout=2.0)
        if self.nats is not None:
            self.nats.close(timeout=2.0)
        for tail in self.tails:
            tail.close(timeout=1.0)
        self.scraper.close(timeout=self.cfg.scrape_timeout + 1.0)
        self.refresher.close(timeout=2.0)
        self.breach_loop.close(timeout=2.0)
        if self.names is not None:
            self.names.detokenizer.stop()
        if self.spans is not None:
            self.spans.close(timeout=1.0)
        if self.state_file is not None:  # last: everything that reached the state is in it
            self.state_file.close(timeout=2.0)

    # ---- views for the landing page and /healthz --------------------------------------------
    def target_status(self) -> list[TargetStatus]:
        gauges = self.health.snapshot()[1]
        up = gauges.get("prefixscope_up", {})
        last_kv = gauges.get("prefixscope_kv_event_last_timestamp_seconds", {})
        stale_after = self.state.thresholds.checks["kv_event_staleness"].value
        now = self.clock()
        rows = []
        for w in self.follower.workers if self.follower is not None else self.workers:
            if w.metrics_url:
                v = up.get((w.name, "worker"))
                rows.append(TargetStatus(w.name, "worker", w.metrics_url, None if v is None else v == 1))
            if w.kv_events:
                rows.append(kv_stream_status(w.name, w.kv_events, last_kv.get((w.name,)), now, stale_after))
        for r in self.cfg.routers:
            v = next((val for (name, _kind), val in up.items() if name == r.name), None)
            rows.append(TargetStatus(r.name, "router", r.metrics_url, None if v is None else v == 1))
        for p in self.cfg.file_records.paths:
            rows.append(TargetStatus(p.name, "records-file", str(p), p.exists()))
        return rows

    def healthz(self) -> tuple[bool, dict[str, Any]]:
        """Unhealthy only when the exporter itself is stuck: its scrape loop has not started a round
        for several intervals, or its state cannot be locked. A slow or failing target is its own
        ``prefixscope_up``, never the exporter's health (every round is bounded by the scrape timeout)."""
        cfg = self.cfg
        started = self.scraper.round_started
        since_round = time.monotonic() - (started if started is not None else self.started_mono)
        stalled = bool(self.scraper.targets) and since_round > STALLED_AFTER_INTERVALS * cfg.scrape_interval + cfg.scrape_timeout
        locked = self.state.lock.acquire(timeout=STATE_LOCK_WAIT_S)
        if locked:
            self.state.lock.release()
        last = max((o.scraped_at for o in self.scraper.last.values()), default=None)
        up = sum(1 for o in self.scraper.last.values() if o.up)
        return not stalled and locked, {
            "version": __version__, "seconds_since_scrape": self.clock() - last if last is not None else None,
            "seconds_since_scrape_round": since_round if started is not None else None,
            "state_lock": "ok" if locked else f"not acquired within {STATE_LOCK_WAIT_S:g}s",
            "targets_scraped": len(self.scraper.targets), "targets_up": up}


def kv_stream_status(worker: str, endpoint: str, last_event_at: float | None, now: float,
                     stale_after_s: float) -> TargetStatus:
    """A worker's KV-event stream as the exporter sees it: streaming (its last batch within the
    staleness limit), stale, or nothing received yet."""
    if last_event_at is None:
        return TargetStatus(worker, "kv_events", endpoint, None, "subscribed, no KV event received yet")
    age = max(0.0, now - last_event_at)
    if age > stale_after_s:
        return TargetStatus(worker, "kv_events", endpoint, False, f"stale: last KV event {format_duration(age)} ago")
    return TargetStatus(worker, "kv_events", endpoint, True,
                        f"streaming: last KV event {format_duration(age) + ' ago' if age >= 1 else 'just now'}")


class ConfigWatch:
    """``--config.auto-reload-interval``: the config file's content, checked every interval."""

    def __init__(self, argv: list[str], interval_s: float) -> None:
        path = build_parser().parse_args(argv).config_file
        self.path = Path(path) if path and interval_s > 0 else None
        self.interval_s = interval_s
        self.checked_at = time.monotonic()
        self.digest = self._digest()

    def _digest(self) -> str | None:
        if self.path is None:
            return None
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None  # gone for a moment (an editor's rename): compared again next time

    def changed(self) -> bool:
        if self.path is None or time.monotonic() - self.checked_at < self.interval_s:
            return False
        self.checked_at = time.monotonic()
        digest = self._digest()
        if digest is None or digest == self.digest:
            return False
        self.digest = digest
        return True


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one and return it: each worker holds a ZMQ
    socket (a mailbox and a connection), a kept-alive scrape connection and, while it replays,
    another socket, so a thousand workers need a few thousand descriptors — past the common
    default soft limit of 1,024."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = resolve_config(argv)
    except ConfigError as exc:
        print(f"prefixscope export: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help/--version (0) or a bad flag (2, message already printed)
        return int(exc.code or 0)
    _configure_logging(cfg.log_level)
    allocator.limit_arenas()  # before any thread of the runtime allocates
    allocator.heap_large_blocks()
    raise_open_files_limit()
    try:
        auto_reload = seconds(build_parser().parse_args(argv).auto_reload, positive=False)
    except ValueError as exc:
        print(f"prefixscope export: --config.auto-reload-interval: {exc}", file=sys.stderr)
        return 2
    try:
        runtime = Runtime.build(cfg, load=lambda: resolve_config(argv))
    except ConfigError as exc:
        print(f"prefixscope export: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the listen address is in use
        print(f"prefixscope export: cannot listen on {cfg.listen_address}: {exc.strerror or exc}", file=sys.stderr)
        return 2

    stop = threading.Event()
    hup = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    def _on_hup(_signum: int, _frame: FrameType | None) -> None:
        hup.set()  # reloaded on the main loop, not inside the handler

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    if hasattr(signal, "SIGHUP"):
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _on_hup)
    watched = ConfigWatch(argv, auto_reload)
    try:
        runtime.start()
        # The address line is the one machine-readable log line: tests and scripts parse it.
        log.info("listening on %s", runtime.url)
        trimmed_at = time.monotonic()
        while not stop.wait(0.5):
            if hup.is_set():
                hup.clear()
                log.info("received SIGHUP, reloading the config")
                runtime.reload()
            elif watched.changed():
                log.info("the config file changed, reloading it")
                runtime.reload()
            if time.monotonic() - trimmed_at >= allocator.TRIM_EVERY_S:
                allocator.trim()
                trimmed_at = time.monotonic()
    finally:
        runtime.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped")
    return 0
