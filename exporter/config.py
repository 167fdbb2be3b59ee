"""The exporter's YAML config, validated at start into frozen dataclasses.

The file's shape is ``prefixscope/schemas/exporter-config.v1.json``; the code adds the checks
that span fields and the files the config names. Every problem is reported, all at once, as
``<file>: <field path>: <problem>`` (for example ``exporter.yaml: workers[2].metrics_url:
expected an http:// or https:// URL, got "foo"``) so an operator can fix the file without
reading code. Loading never raises anything but :class:`ConfigError`.
"""

from __future__ import annotations

import importlib.util
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from exporter.codecs import routers
from exporter.codecs.discovery import pods, relabel
from exporter.model import Limits
from prefixscope.durations import DurationError, seconds
from prefixscope.records import DEFAULT_TS_TOLERANCE_S
from prefixscope.validation import InvalidFile, Problems, read_yaml

PACKAGED_THRESHOLDS = Path(__file__).resolve().parent.parent / "alerts" / "thresholds.yaml"
DEFAULT_LISTEN = "127.0.0.1:9400"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
ROUTER_KINDS = routers.KINDS
SCHEMA_FILE = "exporter-config.v1.json"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(InvalidFile):
    """A config problem, already phrased for the operator (one line per problem)."""


@dataclass(frozen=True)
class WorkerTarget:
    name: str
    metrics_url: str | None = None
    kv_events: str | None = None  # ZMQ endpoint of the worker's PUB socket, or nats://… (the relay's stream)
    replay: str | None = None  # ZMQ endpoint of the worker's ROUTER replay socket
    topic: str = ""
    optional: bool = False  # an optional worker being down is not a telemetry failure
    # (field, value) of the topology labels discovery found on it (``prefixscope.topology.with_discovered``)
    topology: tuple[tuple[str, str], ...] = ()

    def endpoints(self) -> WorkerTarget:
        """The worker without its topology labels: what, changed, makes it a new worker."""
        return replace(self, topology=()) if self.topology else self


@dataclass(frozen=True)
class RouterTarget:
    name: str
    metrics_url: str
    kind: str = "auto"
    max_tree_size: int | None = None  # the router's --max-tree-size, when not its default


@dataclass(frozen=True)
class HttpRecords:
    enabled: bool = True
    bearer_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S  # see FileRecords


@dataclass(frozen=True)
class Web:
    """The HTTP edge: connections served at once, the time a client has to send a request, and
    whether ``POST /-/reload`` is served (a writer: it changes what the exporter follows)."""

    max_connections: int = 64
    read_timeout: float = 10.0
    reload: bool = True


@dataclass(frozen=True)
class FileRecords:
    paths: tuple[Path, ...] = ()
    # a record's ts further than this from the exporter's clock on arrival is rejected (both intakes)
    ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S


@dataclass(frozen=True)
class OtlpTraces:
    """The trace receivers: which spans are requests and which attributes name worker and session.

    ``enabled`` is ``POST /v1/traces`` on the exporter's port (OTLP/HTTP); ``grpc_listen_address``
    turns on OTLP/gRPC ``TraceService/Export`` on a port of its own (what vLLM's and sglang-router's
    ``--otlp-traces-endpoint`` send by default). Both feed the same intake.
    """

    enabled: bool = True
    grpc_listen_address: str | None = None  # e.g. 127.0.0.1:4317; None: no gRPC receiver
    span_names: tuple[str, ...] = ("llm_request",)
    worker_attributes: tuple[str, ...] = ("service.instance.id", "service.name")
    session_attributes: tuple[str, ...] = ()
    cached_attributes: tuple[str, ...] = ("gen_ai.usage.cache_read.input_tokens",)
    session_wait: float = 2.0
    adapter_attributes: tuple[str, ...] = ()  # e.g. gen_ai.request.model on a vLLM that serves LoRA adapters
    tenant_attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NatsKv:
    """``kv_nats``: where the relay's stream and Dynamo's KV events are read from."""

    url: str
    stream: str = "PREFIXSCOPE_KV"
    subject_prefix: str = "prefixscope.kv"
    all_workers: bool = False
    durable: str | None = None  # None: prefixscope-export, with the shard index when sharded
    dynamo_subjects: tuple[str, ...] = ()
    dynamo_block_size: int = 16


SD_MECHANISMS = ("file_sd", "http_sd", "prometheus", "router", "etcd", "kubernetes")
SD_REFRESH = {"file_sd": 300.0, "http_sd": 60.0, "prometheus": 30.0, "router": 15.0, "etcd": 15.0,
              "kubernetes": 60.0}


@dataclass(frozen=True)
class SdProvider:
    """One ``discovery`` entry: where workers are found, how often, and its relabelling."""

    mechanism: str  # one of SD_MECHANISMS
    name: str  # the provider label of the discovery series
    refresh_interval: float
    relabel: tuple[relabel.Rule, ...] = ()
    files: tuple[str, ...] = ()  # file_sd: absolute paths (a glob in the file name allowed)
    url: str | None = None  # http_sd, prometheus, router; kubernetes: its api_server
    job: str | None = None  # prometheus: the scrape pool
    endpoints: tuple[str, ...] = ()  # etcd
    prefix: str = "instances/"  # etcd
    timeout: float = 10.0
    bearer_token: str | None = None
    namespaces: tuple[str, ...] = ()  # kubernetes (empty: the exporter's own)
    label_selector: str | None = None  # kubernetes
    ready_only: bool = True  # kubernetes: only pods that can serve
    kubeconfig: str | None = None  # kubernetes (none: in-cluster, or api_server)


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1


@dataclass(frozen=True)
class Config:
    source: str = "<defaults>"  # the file this came from, for messages
    workers: tuple[WorkerTarget, ...] = ()
    fleet_manifest: Path | None = None
    routers: tuple[RouterTarget, ...] = ()
    http_records: HttpRecords = field(default_factory=HttpRecords)
    file_records: FileRecords = field(default_factory=FileRecords)
    otlp: OtlpTraces = field(default_factory=OtlpTraces)
    topology: Path | None = None
    thresholds: Path = PACKAGED_THRESHOLDS
    scrape_interval: float = 5.0
    scrape_timeout: float = 2.0
    tree_stats_interval: float = 1.0  # background tree-statistics pass, at most this often
    breach_interval: float = 5.0  # background check evaluation that records when each breach began
    window: float | None = None  # None: the thresholds file's window
    prefix_text: bool = False  # keep and serve the first words of hot prefixes (prompts may be private)
    state_file: Path | None = None  # what the exporter keeps across a restart (changes' history, prefix names)
    state_interval: float = 60.0  # how often the state file is written (and once at shutdown)
    attribution: bool = True  # read KV events' lora_name and extra_keys (cache salt) for per-adapter/tenant series
    eviction_memory: int = 4096  # recent evictions kept per worker (thrash, eviction age)
    listen_address: str = DEFAULT_LISTEN
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)
    web: Web = field(default_factory=Web)
    kv_nats: NatsKv | None = None
    shard: Shard = field(default_factory=Shard)
    discovery: tuple[SdProvider, ...] = ()  # workers found by service discovery, besides ``workers``
    worker_down_grace: float = 600.0  # a worker target failing this long has left: never blind

    def with_overrides(self, **changes: Any) -> Config:
        """Flags win over the file; ``None`` means the flag was not given."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def parse_duration(value: Any) -> float:
    """Seconds from a number of seconds or a Prometheus duration (``500ms``, ``5s``, ``1h30m``)."""
    return seconds(value)


def parse_listen_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f'not HOST:PORT: "{value}"')
    return (host.strip("[]") or "0.0.0.0"), int(port)


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def http_writers(cfg: Config) -> list[str]:
    """The routes on the HTTP listener that change what the exporter holds (a new writer goes here)."""
    writers = []
    if cfg.http_records.enabled:
        writers.append("POST /api/v1/records (records.http.enabled)")
    if cfg.otlp.enabled:
        writers.append("POST /v1/traces (otlp.enabled)")
    if cfg.web.reload:
        writers.append("POST /-/reload (web.reload)")
    return writers


def check_intake_auth(cfg: Config) -> None:
    """Every listener that accepts writes — records and OTLP over HTTP, the config reload, OTLP over
    gRPC — needs a bearer token beyond loopback: refuse to start without one, whichever writers are on. The
    gRPC receiver needs a port of its own (checked after the flags' overrides)."""
    host, port = parse_listen_address(cfg.listen_address)
    writers = http_writers(cfg)
    if writers and not cfg.http_records.bearer_token and not is_loopback(host):
        raise ConfigError(
            f"{cfg.source}: listening on {cfg.listen_address} (beyond loopback) with {' and '.join(writers)} "
            "needs records.http.bearer_token or bearer_token_file (every writer shares it), or those writers "
            "turned off")
    grpc_address = cfg.otlp.grpc_listen_address
    if grpc_address is None:
        return
    grpc_host, grpc_port = parse_listen_address(grpc_address)
    if grpc_port and grpc_port == port and (grpc_host == host or "0.0.0.0" in (host, grpc_host)):
        raise ConfigError(f"{cfg.source}: otlp.grpc_listen_address: {grpc_address} is the HTTP listen address "
                          f"{cfg.listen_address}; the gRPC receiver needs a port of its own")
    if not cfg.http_records.bearer_token and not is_loopback(grpc_host):
        raise ConfigError(
            f"{cfg.source}: otlp.grpc_listen_address: listening on {grpc_address} (beyond loopback) needs "
            "records.http.bearer_token or bearer_token_file (the trace receivers share the records intake's token)")


class _Files:
    """Paths of the config, relative to its directory (like Prometheus's rule_files); a file
    that must exist and does not is a problem at its field."""

    def __init__(self, problems: Problems, base_dir: Path) -> None:
        self.problems = problems
        self.base_dir = base_dir

    def path(self, value: Any, where: str, must_exist: bool = True) -> Path | None:
        if not isinstance(value, str) or self.problems.has(where):
            return None
        p = Path(value)
        if not p.is_absolute():
            p = self.base_dir / p
        if must_exist and not p.is_file():
            self.problems.add(where, f'file not found: "{value}"')
            return None
        return p


def _section(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key)
    return value if isinstance(value, Mapping) else {}


def _entries(d: Mapping[str, Any], key: str) -> list[tuple[int, Mapping[str, Any]]]:
    value = d.get(key)
    return [(i, v) for i, v in enumerate(value) if isinstance(v, Mapping)] if isinstance(value, list) else []


def _workers(problems: Problems, d: Mapping[str, Any]) -> tuple[WorkerTarget, ...]:
    out: list[WorkerTarget] = []
    seen: set[str] = set()
    for i, w in _entries(d, "workers"):
        where = f"workers[{i}]"
        name = w.get("name")
        if isinstance(name, str):
            if name in seen:
                problems.add(f"{where}.name", f'duplicate worker name "{name}"')
            seen.add(name)
        if w.get("metrics_url") is None and w.get("kv_events") is None:
            problems.add(where, "needs metrics_url or kv_events (or both)")
        if w.get("replay") is not None and w.get("kv_events") is None:
            problems.add(f"{where}.replay", "replay needs kv_events")
        if str(w.get("kv_events") or "").startswith(("nats://", "tls://")) and w.get("replay") is not None:
            problems.add(f"{where}.replay", "a worker read from NATS has no replay socket (the stream is its replay)")
        out.append(WorkerTarget(name=name, metrics_url=w.get("metrics_url"), kv_events=w.get("kv_events"),
                                replay=w.get("replay"), topic=w.get("topic", ""), optional=bool(w.get("optional"))))
    return tuple(out)


def _routers(d: Mapping[str, Any]) -> tuple[RouterTarget, ...]:
    return tuple(RouterTarget(name=r.get("name"), metrics_url=r.get("metrics_url"), kind=r.get("kind", "auto"),
                              max_tree_size=r.get("max_tree_size"))
                 for _, r in _entries(d, "routers"))


def _records(problems: Problems, files: _Files, d: Mapping[str, Any]) -> tuple[HttpRecords, FileRecords]:
    r = _section(d, "records")
    tolerance = _seconds(problems, r, "ts_tolerance", DEFAULT_TS_TOLERANCE_S, "records") or DEFAULT_TS_TOLERANCE_S
    h = _section(r, "http")
    token = h.get("bearer_token")
    if token is not None and h.get("bearer_token_file") is not None:
        problems.add("records.http", "set bearer_token or bearer_token_file, not both")
    token_file = files.path(h.get("bearer_token_file"), "records.http.bearer_token_file")
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            problems.add("records.http.bearer_token_file", f'cannot read "{token_file}": {exc}')
        if token_file is not None and not token:
            problems.add("records.http.bearer_token_file", f'file is empty: "{token_file}"')
    enabled = h.get("enabled")
    http = HttpRecords(True if enabled is None else enabled, token, h.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES),
                       tolerance)
    paths = _section(r, "file").get("paths") or []
    # A tailed file may not exist yet (the router creates it later): do not require it.
    tailed = [files.path(p, f"records.file.paths[{i}]", must_exist=False) for i, p in enumerate(paths)]
    return http, FileRecords(tuple(p for p in tailed if p is not None), tolerance)


def _otlp(problems: Problems, d: Mapping[str, Any]) -> OtlpTraces:
    o = _section(d, "otlp")
    default = OtlpTraces()

    def names(key: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
        value = o.get(key)
        return tuple(value) if isinstance(value, list) else fallback

    grpc_address = o.get("grpc_listen_address")
    if grpc_address is not None and not problems.has("otlp.grpc_listen_address"):
        try:
            parse_listen_address(str(grpc_address))
        except ValueError as exc:
            problems.add("otlp.grpc_listen_address", str(exc))
            grpc_address = None
    return OtlpTraces(enabled=o.get("enabled") is not False,
                      grpc_listen_address=None if grpc_address is None else str(grpc_address),
                      span_names=names("span_names", default.span_names),
                      worker_attributes=names("worker_attributes", default.worker_attributes),
                      session_attributes=names("session_attributes", default.session_attributes),
                      cached_attributes=names("cached_attributes", default.cached_attributes),
                      session_wait=_seconds(problems, o, "session_wait", default.session_wait, "otlp") or 0.0,
                      adapter_attributes=names("adapter_attributes", default.adapter_attributes),
                      tenant_attributes=names("tenant_attributes", default.tenant_attributes))


def _kv_nats(problems: Problems, d: Mapping[str, Any], workers: tuple[WorkerTarget, ...]) -> NatsKv | None:
    n = d.get("kv_nats")
    urls = {w.kv_events for w in workers if str(w.kv_events or "").startswith(("nats://", "tls://"))}
    if not isinstance(n, Mapping):
        if len(urls) > 1:
            problems.add("workers", f"kv_events name {len(urls)} NATS servers; one exporter reads one stream")
        return NatsKv(url=next(iter(urls))) if urls else None
    url = n.get("url") or (next(iter(urls)) if len(urls) == 1 else None)
    if url is None or not str(url).startswith(("nats://", "tls://")):
        problems.add("kv_nats.url", "needs a nats:// URL (or workers whose kv_events is one)")
        return None
    if urls - {url}:
        problems.add("workers", f"kv_events name NATS servers other than kv_nats.url {url}")
    subjects, block_size = _dynamo(problems, n)
    return NatsKv(url=url, stream=n.get("stream", NatsKv.stream), subject_prefix=n.get("subject_prefix", NatsKv.subject_prefix),
                  all_workers=bool(n.get("all_workers")), durable=n.get("durable"),
                  dynamo_subjects=subjects, dynamo_block_size=block_size)


def dynamo_subjects(namespace: str = "*") -> tuple[str, ...]:
    """Where Dynamo's workers publish KV events in a namespace: 1.6+ (endpoint-scoped) and 1.0
    (component-scoped) event planes."""
    return (f"namespace.{namespace}.component.*.endpoint.*.kv-events", f"namespace.{namespace}.component.*.kv-events")


def _dynamo(problems: Problems, n: Mapping[str, Any]) -> tuple[tuple[str, ...], int]:
    """``kv_nats.dynamo`` (its shape checked by the schema): its subjects (given, or both
    event-plane forms in ``namespace``, every namespace by default) and the engines' block size.
    Absent: no Dynamo subscription."""
    dyn = n.get("dynamo")
    if not isinstance(dyn, Mapping) or problems.has("kv_nats.dynamo"):
        return (), NatsKv.dynamo_block_size
    subjects = dyn.get("subjects")
    block_size = dyn.get("block_size", NatsKv.dynamo_block_size)
    return (tuple(subjects) if subjects else dynamo_subjects(dyn.get("namespace", "*"))), block_size


def _shard(problems: Problems, d: Mapping[str, Any]) -> Shard:
    sh = _section(d, "shard")
    index, count = sh.get("index", 0), sh.get("count", 1)
    if not isinstance(index, int) or not isinstance(count, int) or count < 1 or not 0 <= index < count:
        if not problems.has("shard"):
            problems.add("shard", f"index {index} of count {count}: need 0 <= index < count")
        return Shard()
    return Shard(index, count)


def _discovery(problems: Problems, files: _Files, d: Mapping[str, Any]) -> tuple[SdProvider, ...]:
    section = _section(d, "discovery")
    out: list[SdProvider] = []
    names: set[str] = set()
    for mechanism in SD_MECHANISMS:
        for i, e in _entries(section, mechanism):
            where = f"discovery.{mechanism}[{i}]"
            name = str(e.get("name") or f"{mechanism}_{i}")
            if name in names:
                problems.add(f"{where}.name", f'duplicate discovery name "{name}"')
            names.add(name)
            # the pod annotations' default reading comes first: the config's own rules can override it
            rules = [relabel.rule(r) for r in pods.DEFAULT_RELABEL] if mechanism == "kubernetes" else []
            if mechanism == "kubernetes" and importlib.util.find_spec("kubernetes") is None:
                problems.add(where, "needs the kubernetes package (pip install 'prefixscope[kubernetes]')")
            for j, r in enumerate(e.get("relabel_configs") or []):
                if isinstance(r, Mapping) and not problems.has(f"{where}.relabel_configs[{j}]"):
                    try:
                        rules.append(relabel.rule(r))
                    except relabel.RelabelError as exc:
                        problems.add(f"{where}.relabel_configs[{j}]", str(exc))
            token = None
            token_file = files.path(e.get("bearer_token_file"), f"{where}.bearer_token_file")
            if token_file is not None:
                try:
                    token = token_file.read_text(encoding="utf-8").strip() or None
                except (OSError, UnicodeDecodeError) as exc:
                    problems.add(f"{where}.bearer_token_file", f'cannot read "{token_file}": {exc}')
            paths = tuple(str(files.path(f, f"{where}.files[{k}]", must_exist=False))
                          for k, f in enumerate(e.get("files") or []) if isinstance(f, str))
            def duration(key: str, default: float, e: Mapping[str, Any] = e, where: str = where) -> float:
                value = e.get(key)
                return default if value is None or problems.has(f"{where}.{key}") else seconds(value) or default

            refresh = duration("refresh_interval", SD_REFRESH[mechanism])
            out.append(SdProvider(mechanism=mechanism, name=name, refresh_interval=refresh, relabel=tuple(rules),
                                  files=paths, url=e.get("url") or e.get("api_server"), job=e.get("job"),
                                  endpoints=tuple(e.get("endpoints") or ()), prefix=e.get("prefix", "instances/"),
                                  timeout=duration("timeout", 10.0), bearer_token=token,
                                  namespaces=tuple(e.get("namespaces") or ()), label_selector=e.get("label_selector"),
                                  ready_only=e.get("ready_only") is not False,
                                  kubeconfig=(str(k) if (k := files.path(e.get("kubeconfig"), f"{where}.kubeconfig"))
                                              else None)))
    return tuple(out)


def _seconds(problems: Problems, d: Mapping[str, Any], key: str, default: float | None,
             section: str = "") -> float | None:
    """A duration setting (``section.key``) through the one grammar; a bad one is a problem of the
    file (the one error path), never an exception."""
    where = f"{section}.{key}" if section else key
    value = d.get(key)
    if value is None or problems.has(where):
        return default
    try:
        return seconds(value)
    except DurationError as exc:
        problems.add(where, str(exc))
        return default


def _limits(problems: Problems, d: Mapping[str, Any]) -> Limits:
    s, default = _section(d, "limits"), Limits()
    idle = None if problems.has("limits") else _seconds(problems, s, "label_idle", default.label_idle, "limits")
    return Limits(models=s.get("models") or default.models, segments=s.get("segments") or default.segments,
                  workers=s.get("workers") or default.workers, label_idle=idle or default.label_idle,
                  sessions=s.get("sessions") or default.sessions,
                  hit_history=s.get("hit_history") or default.hit_history,
                  adapters=s.get("adapters") or default.adapters, tenants=s.get("tenants") or default.tenants)


def _web(problems: Problems, d: Mapping[str, Any]) -> Web:
    s, default = _section(d, "web"), Web()
    timeout = None if problems.has("web") else _seconds(problems, s, "read_timeout", default.read_timeout, "web")
    reload = s.get("reload")
    return Web(max_connections=s.get("max_connections") or default.max_connections,
               read_timeout=timeout or default.read_timeout, reload=default.reload if reload is None else reload)


def parse_config(raw: Any, file: str = "<config>", base_dir: Path | None = None) -> Config:
    """Validate an already-loaded YAML document (``schemas/exporter-config.v1.json``, then the
    checks that span fields and the files it names); every problem at once."""
    problems = Problems(file)
    problems.check_schema(raw, SCHEMA_FILE)
    d: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    files = _Files(problems, base_dir or Path.cwd())
    workers = _workers(problems, d)
    http, tailed = _records(problems, files, d)
    topology = files.path(d.get("topology"), "topology")
    thresholds = files.path(d.get("thresholds"), "thresholds")
    fleet_manifest = files.path(d.get("fleet_manifest"), "fleet_manifest", must_exist=False)
    interval = _seconds(problems, d, "scrape_interval", 5.0)
    timeout = _seconds(problems, d, "scrape_timeout", 2.0)
    if interval is not None and timeout is not None and timeout > interval:
        problems.add("scrape_timeout", f"{timeout:g}s exceeds scrape_interval {interval:g}s")
    tree_stats = _seconds(problems, d, "tree_stats_interval", 1.0)
    breach_interval = _seconds(problems, d, "breach_interval", 5.0)
    window = _seconds(problems, d, "window", None)
    otlp = _otlp(problems, d)
    limits, web = _limits(problems, d), _web(problems, d)
    kv_nats = _kv_nats(problems, d, workers)
    shard = _shard(problems, d)
    discovery = _discovery(problems, files, d)
    down_grace = _seconds(problems, d, "worker_down_grace", 600.0)
    state_file = files.path(d.get("state_file"), "state_file", must_exist=False)
    state_interval = _seconds(problems, d, "state_interval", 60.0)
    problems.raise_if_any(ConfigError)
    return Config(source=file, workers=workers, fleet_manifest=fleet_manifest, routers=_routers(d),
                  http_records=http, file_records=tailed, otlp=otlp, topology=topology,
                  thresholds=thresholds or PACKAGED_THRESHOLDS, scrape_interval=interval or 5.0,
                  scrape_timeout=timeout or 2.0, tree_stats_interval=tree_stats or 1.0,
                  breach_interval=breach_interval or 5.0, window=window,
                  prefix_text=d.get("prefix_text") is True,
                  state_file=state_file, state_interval=state_interval or 60.0,
                  attribution=d.get("attribution") is not False,
                  eviction_memory=int(d.get("eviction_memory", 4096)),
                  limits=limits, web=web, kv_nats=kv_nats, shard=shard, discovery=discovery,
                  worker_down_grace=down_grace or 600.0)


def load_config(path: str | Path) -> Config:
    """Read and validate a config file; every failure is a :class:`ConfigError`."""
    p = Path(path)
    return parse_config(read_yaml(p, p.name, ConfigError), p.name, p.resolve().parent)


def load_fleet_manifest(path: Path, source: str = "<config>") -> tuple[WorkerTarget, ...]:
    """Workers from a manifest the simulated fleet writes (JSON or YAML).

    The manifest is a list (or ``{"workers": [...]}``) of ``WorkerFleet.endpoints()`` entries:
    ``name``, ``url`` (the worker's HTTP base URL), ``kv_endpoint``, ``replay_endpoint``, ``topic``.
    """
    where = f"{source}: fleet_manifest"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f'{where}: cannot read "{path}": {exc.strerror or exc}') from None
    except yaml.YAMLError as exc:
        raise ConfigError(f'{where}: "{path}" is not valid JSON or YAML: {exc}') from None
    entries = raw.get("workers") if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise ConfigError(f'{where}: "{path}" must hold a list of workers')
    out: list[WorkerTarget] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("url"), str):
            raise ConfigError(f"{where}: workers[{i}]: needs at least name and url")
        out.append(WorkerTarget(
            name=e["name"], metrics_url=e["url"].rstrip("/") + "/metrics",
            kv_events=e.get("kv_endpoint"), replay=e.get("replay_endpoint"), topic=e.get("topic") or "",
        ))
    return tuple(out)

