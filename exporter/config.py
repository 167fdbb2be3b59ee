"""The exporter's YAML config, validated at start into frozen dataclasses.

The file's shape is ``prefixscope/schemas/exporter-config.v1.json``; the code adds the checks
that span fields and the files the config names. Every problem is reported, all at once, as
``<file>: <field path>: <problem>`` (for example ``exporter.yaml: workers[2].metrics_url:
expected an http:// or https:// URL, got "foo"``) so an operator can fix the file without
reading code. Loading never raises anything but :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from prefixscope.durations import seconds
from prefixscope.validation import InvalidFile, Problems, read_yaml

PACKAGED_THRESHOLDS = Path(__file__).resolve().parent.parent / "alerts" / "thresholds.yaml"
DEFAULT_LISTEN = "127.0.0.1:9400"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
ROUTER_KINDS = ("auto", "sglang-router", "vllm-router")
SCHEMA_FILE = "exporter-config.v1.json"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(InvalidFile):
    """A config problem, already phrased for the operator (one line per problem)."""


@dataclass(frozen=True)
class WorkerTarget:
    name: str
    metrics_url: str | None = None
    kv_events: str | None = None  # ZMQ endpoint of the worker's PUB socket
    replay: str | None = None  # ZMQ endpoint of the worker's ROUTER replay socket
    topic: str = ""
    optional: bool = False  # an optional worker being down is not a telemetry failure


@dataclass(frozen=True)
class RouterTarget:
    name: str
    metrics_url: str
    kind: str = "auto"


@dataclass(frozen=True)
class HttpRecords:
    enabled: bool = True
    bearer_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class FileRecords:
    paths: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Config:
    source: str = "<defaults>"  # the file this came from, for messages
    workers: tuple[WorkerTarget, ...] = ()
    fleet_manifest: Path | None = None
    routers: tuple[RouterTarget, ...] = ()
    http_records: HttpRecords = field(default_factory=HttpRecords)
    file_records: FileRecords = field(default_factory=FileRecords)
    topology: Path | None = None
    thresholds: Path = PACKAGED_THRESHOLDS
    scrape_interval: float = 5.0
    scrape_timeout: float = 2.0
    tree_stats_interval: float = 1.0  # background tree-statistics pass, at most this often
    window: float | None = None  # None: the thresholds file's window
    eviction_memory: int = 4096  # recent evictions kept per worker (thrash, eviction age)
    listen_address: str = DEFAULT_LISTEN
    log_level: str = "info"

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
        out.append(WorkerTarget(name=name, metrics_url=w.get("metrics_url"), kv_events=w.get("kv_events"),
                                replay=w.get("replay"), topic=w.get("topic", ""), optional=bool(w.get("optional"))))
    return tuple(out)


def _routers(d: Mapping[str, Any]) -> tuple[RouterTarget, ...]:
    return tuple(RouterTarget(name=r.get("name"), metrics_url=r.get("metrics_url"), kind=r.get("kind", "auto"))
                 for _, r in _entries(d, "routers"))


def _records(problems: Problems, files: _Files, d: Mapping[str, Any]) -> tuple[HttpRecords, FileRecords]:
    h = _section(_section(d, "records"), "http")
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
    http = HttpRecords(True if enabled is None else enabled, token, h.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))
    paths = _section(_section(d, "records"), "file").get("paths") or []
    # A tailed file may not exist yet (the router creates it later): do not require it.
    tailed = [files.path(p, f"records.file.paths[{i}]", must_exist=False) for i, p in enumerate(paths)]
    return http, FileRecords(tuple(p for p in tailed if p is not None))


def _seconds(problems: Problems, d: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = d.get(key)
    if value is None or problems.has(key):
        return default
    return seconds(value)


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
    window = _seconds(problems, d, "window", None)
    problems.raise_if_any(ConfigError)
    return Config(source=file, workers=workers, fleet_manifest=fleet_manifest, routers=_routers(d),
                  http_records=http, file_records=tailed, topology=topology,
                  thresholds=thresholds or PACKAGED_THRESHOLDS, scrape_interval=interval or 5.0,
                  scrape_timeout=timeout or 2.0, tree_stats_interval=tree_stats or 1.0, window=window,
                  eviction_memory=int(d.get("eviction_memory", 4096)))


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

