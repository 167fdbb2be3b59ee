"""The exporter's HTTP edge: one threaded stdlib server for /metrics, /api/v1/* and the landing page.

The server holds no state and computes nothing: it renders a private ``CollectorRegistry``,
calls the JSON payload builders it is given and hands record bodies to an intake callable.
Routing is a table (``exporter.web.routes``): method + path → handler. Handlers return a response
or raise ``HttpError``; the one error path turns every exception into a JSON answer
(``{"status": "error", "error": ...}``) with its 4xx/5xx code, logged once.
"""

from __future__ import annotations

import contextlib
import gzip
import hmac
import html
import io
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from exporter.config import is_loopback
from exporter.loops.duty_clock import DutyClock
from exporter.web.routes import (
    BadRequest,
    HttpError,
    Request,
    Response,
    RouteTable,
    error_response,
    json_response,
)
from prefixscope import __version__, catalog

log = logging.getLogger("prefixscope.server")

API_PREFIX = "/api/v1/"
RECORDS_PATH = API_PREFIX + "records"
RELOAD_PATH = "/-/reload"
BODYLESS = frozenset({"GET", "HEAD"})
BODY_CHUNK = 64 * 1024  # a body is read in chunks: memory follows what arrived, not what was announced
ADMIT_WAIT_S = 1.0  # a connection beyond the cap waits this long for a slot, then gets 503
__all__ = ["BadRequest", "Endpoints", "ExporterServer", "HttpError", "IntakeResult", "ServerDeps", "TargetStatus"]


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
    # Renders the Prometheus text format directly (``exporter.web.exposition.render_state``); the
    # registry still serves OpenMetrics. None: the registry serves both.
    render_text: Callable[[], bytes] | None = None
    # POST /v1/traces (OTLP/HTTP, ``exporter.web.otlp_http``); None: the trace receiver is off.
    ingest_traces: Callable[[Request], Response] | None = None
    max_connections: int = 64  # connections served at once
    read_timeout: float = 10.0  # seconds a client has to send one whole request (line, headers, body)
    duties: DutyClock = field(default_factory=DutyClock)  # times /metrics renders and record bodies
    # POST /-/reload: reloads the config file, (ok, what happened); None: no such endpoint
    reload: Callable[[], tuple[bool, str]] | None = None


class Endpoints:
    """The exporter's endpoints over its dependencies; :meth:`routes` is the route table."""

    def __init__(self, deps: ServerDeps) -> None:
        self.deps = deps

    def api(self) -> Mapping[str, ApiBuilder]:
        return {"catalog": lambda _q: catalog.as_dict(), **self.deps.api}

    def routes(self) -> RouteTable:
        table = (RouteTable()
                 .add("GET", "/", self.landing)
                 .add("GET", "/metrics", self.metrics)
                 .add("GET", "/healthz", self.healthz)
                 .add("POST", RECORDS_PATH, self.records, wrong_method_hint="use POST with an NDJSON body"))
        if self.deps.reload is not None:
            table.add("POST", RELOAD_PATH, self.reload, wrong_method_hint="use POST to reload the config file")
        if self.deps.ingest_traces is not None:
            table.add("POST", "/v1/traces", self.deps.ingest_traces, wrong_method_hint="use POST with an OTLP body")
        for name, builder in self.api().items():
            table.add("GET", API_PREFIX + name, partial(self.api_get, builder))
        return table

    # ---- GET ----------------------------------------------------------------------------
    def landing(self, _req: Request) -> Response:
        return Response(200, self._landing().encode(), "text/html; charset=utf-8")

    def healthz(self, _req: Request) -> Response:
        ok, detail = self.deps.healthz()
        return json_response(200 if ok else 503, {"status": "ok" if ok else "error", "data": detail})

    @staticmethod
    def api_get(builder: ApiBuilder, req: Request) -> Response:
        return json_response(200, {"status": "ok", "data": builder(req.query)})  # BadRequest: 400

    def metrics(self, req: Request) -> Response:
        encoder, ctype = choose_encoder(req.header("Accept"))
        headers = {}
        with self.deps.duties.duty("render"):
            if self.deps.render_text is not None and not ctype.startswith("application/openmetrics-text"):
                body = self.deps.render_text()
            else:
                body = encoder(self.deps.registry)
            if "gzip" in (req.header("Accept-Encoding") or ""):
                body = gzip.compress(body, compresslevel=5)
                headers["Content-Encoding"] = "gzip"
        return Response(200, body, ctype, headers)

    def _landing(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(t.name)}</td><td>{html.escape(t.kind)}</td><td>{html.escape(t.url)}</td>"
            f"<td>{'up' if t.up else 'not yet scraped' if t.up is None else '<b>down</b>'}</td></tr>"
            for t in self.deps.targets()
        ) or '<tr><td colspan="4">no targets configured</td></tr>'
        api = "".join(f'<li><a href="{API_PREFIX}{n}">{API_PREFIX}{n}</a></li>' for n in self.api())
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
    def _authorised(self, req: Request) -> bool:
        token = self.deps.bearer_token
        if token is None:
            return True
        scheme, _, given = (req.header("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

    def reload(self, req: Request) -> Response:
        """Reload the config file (as SIGHUP does). From this machine anyone may; from beyond
        loopback only with the bearer token (and never without one configured)."""
        assert self.deps.reload is not None
        if not is_loopback(req.client) and (self.deps.bearer_token is None or not self._authorised(req)):
            raise HttpError("reload is allowed from this machine, or with the exporter's bearer token", 403)
        ok, message = self.deps.reload()
        if not ok:
            return json_response(500, {"status": "error", "error": f"reload failed, running configuration kept: {message}"})
        return json_response(200, {"status": "success", "data": {"message": message}})

    def records(self, req: Request) -> Response:
        deps = self.deps
        if deps.ingest_ndjson is None:
            raise HttpError("record intake over HTTP is disabled in the exporter's config", 404)
        if not self._authorised(req):
            raise HttpError("missing or wrong bearer token", 401, {"WWW-Authenticate": 'Bearer realm="prefixscope"'})
        length_header = req.header("Content-Length")
        if length_header is None or not length_header.isdigit():
            raise HttpError("Content-Length is required", 411)
        length = int(length_header)
        if length > deps.max_body_bytes:
            raise HttpError(f"body of {length} bytes exceeds the limit of {deps.max_body_bytes} bytes", 413)
        body = req.read_body(length)
        with deps.duties.duty("records"):  # parsing and applying; reading the body is the client's pace
            result = deps.ingest_ndjson(body)
        data = {"accepted": result.accepted, "rejected": result.rejected, "errors": result.errors}
        if result.rejected > 0:
            # The valid lines are applied all the same; the sender learns which lines to fix.
            error = (f"{result.rejected} invalid line(s) rejected, {result.accepted} record(s) accepted; "
                     "see data.errors")
            return json_response(400, {"status": "error", "error": error, "data": data})
        return json_response(200, {"status": "ok", "data": data})


class RequestTimeout(TimeoutError):
    """The client did not send its whole request within the read timeout."""


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by what is left of one request's deadline.

    A per-read timeout alone never fires for a client that drips a byte at a time; here the
    whole request (request line, headers, body) — and the idle time before it on a kept-alive
    connection — has ``read_timeout`` seconds.
    """

    def __init__(self, sock: socket.socket, read_timeout: float) -> None:
        self.sock = sock
        self.read_timeout = read_timeout
        self.deadline = time.monotonic() + read_timeout

    def restart(self) -> None:
        self.deadline = time.monotonic() + self.read_timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout("request not received within the read timeout")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            raise RequestTimeout("request not received within the read timeout") from None


class _Handler(BaseHTTPRequestHandler):
    server_version = f"prefixscope/{__version__}"
    protocol_version = "HTTP/1.1"
    routes: RouteTable  # set on the subclass built per server
    read_timeout: float = 10.0  # set on the subclass built per server
    _reader: _DeadlineReader

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def setup(self) -> None:
        super().setup()
        # An answer goes out in one write (``_send``); with Nagle's algorithm on, a kept-alive
        # client's next request would still wait for the delayed ACK of the previous answer's tail.
        with contextlib.suppress(OSError):  # (a socket that is not TCP: nothing to turn off)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()  # the stock reader (its socket reference) makes way for the deadline reader
        self._reader = _DeadlineReader(self.connection, self.read_timeout)
        self.rfile = io.BufferedReader(self._reader, BODY_CHUNK)

    def handle_one_request(self) -> None:
        self._reader.restart()  # the next request (or the idle wait for it) has its own deadline
        try:
            super().handle_one_request()
        except RequestTimeout:
            log.debug("%s: closed, request not received within %gs", self.address_string(), self.read_timeout)
            self.close_connection = True

    def _read_body(self, length: int) -> bytes:
        chunks, left = [], length
        while left > 0:
            chunk = self.rfile.read(min(left, BODY_CHUNK))
            if not chunk:
                raise HttpError(f"body ended after {length - left} of {length} bytes", 400)
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _dispatch(self) -> None:
        """Route the request; every failure becomes one JSON error answer, logged once."""
        parts = urlsplit(self.path)
        path = parts.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        req = Request(self.command, path, query, self.headers, self._read_body, str(self.client_address[0]))
        try:
            response = self.routes.resolve(self.command, path)(req)
        except RequestTimeout:
            self.close_connection = True
            response = error_response(HttpError(f"request body not received within {self.read_timeout:g}s", 408))
        except HttpError as exc:
            log.debug("%s %s: %d %s", self.command, self.path, exc.status, exc.message)
            response = self._failed(error_response(exc))
        except Exception:  # a bug in one handler must not take the server down
            log.exception("error serving %s %s", self.command, self.path)
            response = self._failed(error_response(HttpError("internal error; see the exporter log", 500)))
        self._send(response)

    def _failed(self, response: Response) -> Response:
        # A request that may carry a body we did not read: close, so it is not parsed as the next request.
        if self.command not in BODYLESS:
            self.close_connection = True
        return response

    def _send(self, response: Response) -> None:
        self.connection.settimeout(self.read_timeout)  # a client that does not read its answer is dropped too
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for k, v in response.headers.items():
            self.send_header(k, v)
        # Headers and body in one write: two writes would leave the body waiting for the
        # client's delayed ACK of the headers (~40 ms a request on a kept-alive connection).
        self._headers_buffer.append(b"\r\n")
        if self.command != "HEAD":
            self._headers_buffer.append(response.body)
        self.flush_headers()

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch


BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


class _BoundedHTTPServer(ThreadingHTTPServer):
    """At most ``max_connections`` connections served at once (one thread each).

    A connection beyond the cap waits up to ``ADMIT_WAIT_S`` for a slot, then gets 503 and is
    closed; together with the read timeout, idle or slow clients cannot pile up threads.
    """

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_connections: int) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(timeout=ADMIT_WAIT_S):
            self.refused += 1
            body = (b'{"status":"error","error":"too many connections (%d); retry shortly"}'
                    % self.max_connections)
            try:
                request.settimeout(0.5)
                request.sendall(BUSY % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer is its own business: one debug line, no traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("%s: connection failed: %s", client_address, exc)
        else:
            log.exception("error serving %s", client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ExporterServer:
    """A bounded threading HTTP server on ``host:port`` (port 0 picks a free one), served from a thread."""

    def __init__(self, host: str, port: int, deps: ServerDeps) -> None:
        handler = type("Handler", (_Handler,), {"routes": Endpoints(deps).routes(),
                                                 "read_timeout": deps.read_timeout})
        self.httpd = _BoundedHTTPServer((host, port), handler, deps.max_connections)
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
