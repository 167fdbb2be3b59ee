"""The exporter's HTTP edge: one threaded stdlib server for /metrics, /api/v1/* and the landing page.

The server holds no state and computes nothing: it renders a private ``CollectorRegistry``,
calls the JSON payload builders it is given and hands record bodies to an intake callable.
Every error answer is JSON (``{"status": "error", "error": ...}``) with a 4xx/5xx code.
"""

from __future__ import annotations

import gzip
import hmac
import html
import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from prefixscope import __version__, catalog

log = logging.getLogger("prefixscope.server")

API_PREFIX = "/api/v1/"
RECORDS_PATH = API_PREFIX + "records"


@dataclass(frozen=True)
class TargetStatus:
    """One scraped or subscribed target, for the landing page."""

    name: str
    kind: str  # worker, router, kv_events, records-file
    url: str
    up: bool | None  # None: not yet scraped


@dataclass(frozen=True)
class IntakeResult:
    accepted: int
    rejected: int
    errors: list[dict[str, Any]]  # [{"line": n, "error": "..."}]


class BadRequest(ValueError):
    """Raised by an API builder for an invalid query parameter (answered as 400)."""


Query = Mapping[str, str]
ApiBuilder = Callable[[Query], Any]


@dataclass
class ServerDeps:
    registry: CollectorRegistry
    api: Mapping[str, ApiBuilder]  # "groups" -> builder(query) returning the payload's data
    ingest_ndjson: Callable[[bytes], IntakeResult] | None = None  # None: HTTP intake disabled
    bearer_token: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    targets: Callable[[], list[TargetStatus]] = list
    healthz: Callable[[], tuple[bool, dict[str, Any]]] = lambda: (True, {})
    extra: dict[str, Any] = field(default_factory=dict)
    # Renders the Prometheus text format directly (``exporter.exposition.render_state``); the
    # registry still serves OpenMetrics. None: the registry serves both.
    render_text: Callable[[], bytes] | None = None


def _finite(value: Any) -> Any:
    """NaN/inf are not JSON: a non-finite value means "no value", so it becomes null (never 0)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(_finite(payload), default=str, separators=(",", ":"), allow_nan=False).encode()


class _Handler(BaseHTTPRequestHandler):
    server_version = f"prefixscope/{__version__}"
    protocol_version = "HTTP/1.1"
    deps: ServerDeps  # set on the subclass built per server

    # ---- plumbing ---------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, code: int, body: bytes, ctype: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(code, _json_bytes(payload), "application/json", headers)

    def _error(self, code: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        self._json(code, {"status": "error", "error": message}, headers)

    def _route(self) -> tuple[str, dict[str, str]]:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return (parts.path.rstrip("/") or "/"), query

    # ---- GET ----------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path, query = self._route()
        try:
            if path == "/":
                self._send(200, self._landing().encode(), "text/html; charset=utf-8")
            elif path == "/metrics":
                self._metrics()
            elif path == "/healthz":
                ok, detail = self.deps.healthz()
                self._json(200 if ok else 503, {"status": "ok" if ok else "error", "data": detail})
            elif path == RECORDS_PATH:
                self._error(405, "use POST with an NDJSON body", {"Allow": "POST"})
            elif path.startswith(API_PREFIX) and path[len(API_PREFIX):] in self._api():
                self._api_get(path[len(API_PREFIX):], query)
            else:
                self._error(404, f"no such endpoint: {path}")
        except Exception:  # a bug in one builder must not take the server down
            log.exception("error serving GET %s", self.path)
            self._error(500, "internal error; see the exporter log")

    def _api(self) -> Mapping[str, ApiBuilder]:
        return {"catalog": lambda _q: catalog.as_dict(), **self.deps.api}

    def _api_get(self, name: str, query: dict[str, str]) -> None:
        try:
            data = self._api()[name](query)
        except BadRequest as exc:
            self._error(400, str(exc))
            return
        self._json(200, {"status": "ok", "data": data})

    def _metrics(self) -> None:
        encoder, ctype = choose_encoder(self.headers.get("Accept"))
        if self.deps.render_text is not None and not ctype.startswith("application/openmetrics-text"):
            body = self.deps.render_text()
        else:
            body = encoder(self.deps.registry)
        headers = {}
        if "gzip" in (self.headers.get("Accept-Encoding") or ""):
            body = gzip.compress(body, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        self._send(200, body, ctype, headers)

    def _landing(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(t.name)}</td><td>{html.escape(t.kind)}</td><td>{html.escape(t.url)}</td>"
            f"<td>{'up' if t.up else 'not yet scraped' if t.up is None else '<b>down</b>'}</td></tr>"
            for t in self.deps.targets()
        ) or '<tr><td colspan="4">no targets configured</td></tr>'
        api = "".join(f'<li><a href="{API_PREFIX}{n}">{API_PREFIX}{n}</a></li>' for n in self._api())
        intake = (f"<li>POST {RECORDS_PATH} (NDJSON, prefixscope.request/v1)</li>"
                  if self.deps.ingest_ndjson else "<li>record intake over HTTP is disabled</li>")
        return (
            "<!doctype html><html><head><meta charset='utf-8'><title>prefixscope exporter</title></head><body>"
            f"<h1>prefixscope exporter {html.escape(__version__)}</h1>"
            "<p>Prefix-cache locality of an LLM inference cluster: the five checklist groups, the reuse "
            "decomposition, KV-event stream health and prefix-tree hotspots.</p>"
            '<ul><li><a href="/metrics">/metrics</a> (Prometheus)</li><li><a href="/healthz">/healthz</a></li>'
            f"{api}{intake}</ul>"
            "<h2>Targets</h2><table border='1' cellpadding='4'><tr><th>name</th><th>kind</th><th>url</th>"
            f"<th>state</th></tr>{rows}</table></body></html>"
        )

    # ---- POST ---------------------------------------------------------------------------
    def do_POST(self) -> None:
        path, _ = self._route()
        if path != RECORDS_PATH:
            if path in ("/", "/metrics", "/healthz") or path[len(API_PREFIX):] in self._api():
                self._error(405, "method not allowed", {"Allow": "GET"})
            else:
                self._error(404, f"no such endpoint: {path}")
            self.close_connection = True
            return
        try:
            self._records()
        except Exception:
            log.exception("error serving POST %s", self.path)
            self.close_connection = True
            self._error(500, "internal error; see the exporter log")

    def _authorised(self) -> bool:
        token = self.deps.bearer_token
        if token is None:
            return True
        scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

    def _records(self) -> None:
        deps = self.deps
        if deps.ingest_ndjson is None:
            self.close_connection = True
            self._error(404, "record intake over HTTP is disabled in the exporter's config")
            return
        if not self._authorised():
            # The body is not read: close so it is not parsed as the next request.
            self.close_connection = True
            self._error(401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="prefixscope"'})
            return
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.isdigit():
            self.close_connection = True
            self._error(411, "Content-Length is required")
            return
        length = int(length_header)
        if length > deps.max_body_bytes:
            self.close_connection = True
            self._error(413, f"body of {length} bytes exceeds the limit of {deps.max_body_bytes} bytes")
            return
        body = self.rfile.read(length)
        result = deps.ingest_ndjson(body)
        data = {"accepted": result.accepted, "rejected": result.rejected, "errors": result.errors}
        if result.accepted == 0 and result.rejected > 0:
            self._json(400, {"status": "error", "error": "no valid record in the body", "data": data})
        else:
            self._json(200, {"status": "ok", "data": data})

    def do_PUT(self) -> None:
        self._not_allowed()

    def do_DELETE(self) -> None:
        self._not_allowed()

    def do_PATCH(self) -> None:
        self._not_allowed()

    def _not_allowed(self) -> None:
        self.close_connection = True
        path, _ = self._route()
        self._error(405, f"method {self.command} not allowed on {path}",
                    {"Allow": "POST" if path == RECORDS_PATH else "GET"})


class ExporterServer:
    """A ``ThreadingHTTPServer`` on ``host:port`` (port 0 picks a free one), served from a thread."""

    def __init__(self, host: str, port: int, deps: ServerDeps) -> None:
        handler = type("Handler", (_Handler,), {"deps": deps})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> ExporterServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="prefixscope-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=2)
