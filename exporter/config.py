"""The exporter's YAML config, validated at start into frozen dataclasses.

Every problem is reported as ``<file>: <field path>: <problem>`` (for example
``exporter.yaml: workers[2].metrics_url: not a URL: "foo"``) so an operator can fix the file
without reading code. Loading never raises anything but :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from prefixscope.durations import seconds
from prefixscope.records import DEFAULT_TS_TOLERANCE_S

PACKAGED_THRESHOLDS = Path(__file__).resolve().parent.parent / "alerts" / "thresholds.yaml"
DEFAULT_LISTEN = "127.0.0.1:9400"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
ROUTER_KINDS = ("auto", "sglang-router", "vllm-router")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A config problem, already phrased for the operator."""


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
    ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S  # see FileRecords


@dataclass(frozen=True)
class FileRecords:
    paths: tuple[Path, ...] = ()
    # a record's ts further than this from the exporter's clock on arrival is rejected (both intakes)
    ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S


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


class _Reader:
    """Walks the YAML tree, remembering the field path for messages."""

    def __init__(self, file: str, base_dir: Path) -> None:
        self.file = file
        self.base_dir = base_dir

    def fail(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.file}: {where}: {problem}" if where else f"{self.file}: {problem}")

    def mapping(self, value: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise self.fail(where, f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")
        return value

    def string(self, value: Any, where: str, required: bool = False) -> str | None:
        if value is None:
            if required:
                raise self.fail(where, "required")
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f"expected a non-empty string, got {value!r}")
        return value

    def url(self, value: Any, where: str, schemes: tuple[str, ...], required: bool = False) -> str | None:
        text = self.string(value, where, required)
        if text is None:
            return None
        parts = urlsplit(text)
        if parts.scheme not in schemes or not parts.netloc:
            raise self.fail(where, f'not a URL: "{text}" (expected {" or ".join(s + "://" for s in schemes)}...)')
        return text

    def boolean(self, value: Any, where: str, default: bool) -> bool:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {value!r}")
        return value

    def path(self, value: Any, where: str, must_exist: bool = True) -> Path | None:
        text = self.string(value, where)
        if text is None:
            return None
        p = Path(text)
        if not p.is_absolute():
            p = self.base_dir / p  # relative to the config file, like Prometheus's rule_files
        if must_exist and not p.is_file():
            raise self.fail(where, f'file not found: "{text}"')
        return p

    def convert(self, value: Any, where: str, fn: Callable[[Any], Any]) -> Any:
        try:
            return fn(value)
        except (TypeError, ValueError) as exc:
            raise self.fail(where, str(exc)) from None

    def items(self, value: Any, where: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(where, f"expected a list, got {type(value).__name__}")
        return value


def _workers(r: _Reader, raw: Any) -> tuple[WorkerTarget, ...]:
    out: list[WorkerTarget] = []
    seen: set[str] = set()
    for i, item in enumerate(r.items(raw, "workers")):
        where = f"workers[{i}]"
        d = r.mapping(item, where, ("name", "metrics_url", "kv_events", "replay", "topic", "optional"))
        name = r.string(d.get("name"), f"{where}.name", required=True)
        assert name is not None
        if name in seen:
            raise r.fail(f"{where}.name", f'duplicate worker name "{name}"')
        seen.add(name)
        topic = d.get("topic", "")
        if not isinstance(topic, str):
            raise r.fail(f"{where}.topic", f"expected a string, got {topic!r}")
        w = WorkerTarget(
            name=name,
            metrics_url=r.url(d.get("metrics_url"), f"{where}.metrics_url", ("http", "https")),
            kv_events=r.url(d.get("kv_events"), f"{where}.kv_events", ("tcp", "ipc", "inproc")),
            replay=r.url(d.get("replay"), f"{where}.replay", ("tcp", "ipc", "inproc")),
            topic=topic,
            optional=r.boolean(d.get("optional"), f"{where}.optional", False),
        )
        if w.metrics_url is None and w.kv_events is None:
            raise r.fail(where, "needs metrics_url or kv_events (or both)")
        if w.replay is not None and w.kv_events is None:
            raise r.fail(f"{where}.replay", "replay needs kv_events")
        out.append(w)
    return tuple(out)


def _routers(r: _Reader, raw: Any) -> tuple[RouterTarget, ...]:
    out: list[RouterTarget] = []
    for i, item in enumerate(r.items(raw, "routers")):
        where = f"routers[{i}]"
        d = r.mapping(item, where, ("name", "metrics_url", "kind"))
        kind = d.get("kind", "auto")
        if kind not in ROUTER_KINDS:
            raise r.fail(f"{where}.kind", f"must be one of {', '.join(ROUTER_KINDS)}, got {kind!r}")
        out.append(RouterTarget(
            name=r.string(d.get("name"), f"{where}.name", required=True) or "",
            metrics_url=r.url(d.get("metrics_url"), f"{where}.metrics_url", ("http", "https"), required=True) or "",
            kind=kind,
        ))
    return tuple(out)


def _records(r: _Reader, raw: Any) -> tuple[HttpRecords, FileRecords]:
    d = r.mapping(raw, "records", ("http", "file", "ts_tolerance"))
    tolerance = r.convert(d.get("ts_tolerance", DEFAULT_TS_TOLERANCE_S), "records.ts_tolerance", parse_duration)
    h = r.mapping(d.get("http"), "records.http", ("enabled", "bearer_token", "bearer_token_file", "max_body_bytes"))
    token = r.string(h.get("bearer_token"), "records.http.bearer_token")
    token_file = r.path(h.get("bearer_token_file"), "records.http.bearer_token_file")
    if token is not None and token_file is not None:
        raise r.fail("records.http", "set bearer_token or bearer_token_file, not both")
    if token_file is not None:
        token = token_file.read_text(encoding="utf-8").strip()
        if not token:
            raise r.fail("records.http.bearer_token_file", f'file is empty: "{token_file}"')
    max_body = h.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body <= 0:
        raise r.fail("records.http.max_body_bytes", f"expected a positive integer, got {max_body!r}")
    http = HttpRecords(r.boolean(h.get("enabled"), "records.http.enabled", True), token, max_body, tolerance)
    f = r.mapping(d.get("file"), "records.file", ("paths",))
    paths = []
    for i, p in enumerate(r.items(f.get("paths"), "records.file.paths")):
        # A tailed file may not exist yet (the router creates it later): do not require it.
        path = r.path(p, f"records.file.paths[{i}]", must_exist=False)
        assert path is not None
        paths.append(path)
    return http, FileRecords(tuple(paths), tolerance)


TOP_LEVEL = ("workers", "fleet_manifest", "routers", "records", "topology", "thresholds",
             "scrape_interval", "scrape_timeout", "tree_stats_interval", "window")


def parse_config(raw: Any, file: str = "<config>", base_dir: Path | None = None) -> Config:
    """Validate an already-loaded YAML document."""
    r = _Reader(file, base_dir or Path.cwd())
    d = r.mapping(raw, "", TOP_LEVEL)
    http, files = _records(r, d.get("records"))
    cfg = Config(
        source=file,
        workers=_workers(r, d.get("workers")),
        fleet_manifest=r.path(d.get("fleet_manifest"), "fleet_manifest", must_exist=False),
        routers=_routers(r, d.get("routers")),
        http_records=http,
        file_records=files,
        topology=r.path(d.get("topology"), "topology"),
        thresholds=r.path(d.get("thresholds"), "thresholds") or PACKAGED_THRESHOLDS,
        scrape_interval=r.convert(d.get("scrape_interval", 5.0), "scrape_interval", parse_duration),
        scrape_timeout=r.convert(d.get("scrape_timeout", 2.0), "scrape_timeout", parse_duration),
        tree_stats_interval=r.convert(d.get("tree_stats_interval", 1.0), "tree_stats_interval", parse_duration),
        window=r.convert(d["window"], "window", parse_duration) if d.get("window") is not None else None,
    )
    if cfg.scrape_timeout > cfg.scrape_interval:
        raise r.fail("scrape_timeout", f"{cfg.scrape_timeout:g}s exceeds scrape_interval {cfg.scrape_interval:g}s")
    return cfg


def load_config(path: str | Path) -> Config:
    """Read and validate a config file; every failure is a :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p.name}: invalid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    return parse_config(raw, p.name, p.resolve().parent)


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

