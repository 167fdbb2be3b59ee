"""The exporter's HTTP edge: /metrics, /healthz, /api/v1/*, the intakes and the landing page.

One loop thread accepts connections and reads request heads (no thread per connection, a head
timeout of a few seconds, a cap on the connections waiting per client and in all); whole heads
are served by two pools — the scrapes (/metrics, /healthz) by a small pool of their own, every
other request by ``web.max_connections`` threads — so a scrape never waits behind writers, and
the request bodies held at once have a budget. See the notes above ``SCRAPE_PATHS``.

The server holds no state and computes nothing: it renders a private ``CollectorRegistry``,
calls the JSON payload builders it is given and hands record bodies to an intake callable.
Routing is a table (``exporter.web.routes``): method + path → handler. Handlers return a response
or raise ``HttpError``; the one error path turns every exception into a JSON answer
(``{"status": "error", "error": ...}``) with its 4xx/5xx code, logged once.
"""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import hmac
import html
import http
import http.client
import io
import json
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
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
ADMIT_WAIT_S = 1.0  # a request beyond the pool's threads waits this long in its queue, then gets 503
__all__ = ["BadRequest", "Endpoints", "ExporterServer", "HttpError", "IntakeResult", "ServerDeps", "TargetStatus"]


@dataclass(frozen=True)
class TargetStatus:
    """One scraped or subscribed target, for the landing page."""

    name: str
    kind: str  # worker, router, kv_events, records-file
    url: str
    up: bool | None  # None: not yet scraped
    detail: str | None = None  # how the exporter sees it, when it says more than up/down (a KV stream)


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


# Prometheus asks for gzip at every scrape. At 1,000 workers the text is ~5 MB: level 5 took 16 ms
# of CPU to compress it, as long as the scrape itself; level 1 takes half that for a body about 8 %
# larger (~0.3 MB either way).
GZIP_LEVEL = 1


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
                body = gzip.compress(body, compresslevel=GZIP_LEVEL)
                headers["Content-Encoding"] = "gzip"
        return Response(200, body, ctype, headers)

    def _landing(self) -> str:
        """The exporter's front page: its endpoints and each target as the exporter sees it (a KV
        stream by its last event: streaming, stale, or nothing received yet)."""
        rows = "".join(
            f"<tr><td>{html.escape(t.name)}</td><td>{html.escape(t.kind)}</td><td>{html.escape(t.url)}</td>"
            f"<td>{_state(t)}</td></tr>"
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


class _Closed(ConnectionError):
    """The client closed the connection before sending what it announced."""


# ---- connections --------------------------------------------------------------------------------
# One thread (the loop) accepts every connection and reads every request head, without a thread
# per connection: an idle, trickling or half-open client costs a socket and the bytes it sent,
# never a thread, and is closed when its head has not arrived within the head timeout. A whole
# head goes to one of two pools: scrapes (GET/HEAD /metrics and /healthz) to a small pool of
# their own, everything else to the request pool. A scrape therefore never waits behind a writer,
# however many writers send slowly; and a kept-alive connection goes back to the loop between
# requests.
SCRAPE_PATHS = frozenset({"/metrics", "/healthz"})
SCRAPE_THREADS = 2  # a render takes milliseconds; two keep one slow reader from holding scrapes
HEAD_TIMEOUT_S = 5.0  # a request head (line and headers), or the idle wait for the next one (at most read_timeout)
MAX_HEAD_BYTES = 64 * 1024
MAX_WAITING = 1024  # connections without a whole head held at once; past it the oldest is closed
MAX_WAITING_PER_CLIENT = 256  # ... and from one client address
BODY_BUDGET_BYTES = 64 * 1024 * 1024  # request bodies announced and held at once (at least 2 bodies' limit)
POLL_S = 0.25


def _response_bytes(status: int, content_type: str, body: bytes, headers: Mapping[str, str], close: bool,
                    head_only: bool = False) -> bytes:
    reason = _REASONS.get(status, "")
    lines = [f"HTTP/1.1 {status} {reason}", f"Server: prefixscope/{__version__}",
             f"Date: {email.utils.formatdate(usegmt=True)}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")
    return head if head_only else head + body


_REASONS = {s.value: s.phrase for s in http.HTTPStatus}


def _busy(message: str, status: int = 503) -> bytes:
    body = json.dumps({"status": "error", "error": message}).encode()
    return _response_bytes(status, "application/json", body, {"Retry-After": "1"}, close=True)


class _Conn:
    """A client connection: its socket, the bytes read past the last request, and its deadline."""

    __slots__ = ("addr", "buf", "client", "deadline", "sock")

    def __init__(self, sock: socket.socket, addr: Any, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.client = addr[0] if isinstance(addr, tuple) else str(addr)
        self.buf = bytearray()
        self.deadline = deadline

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class _Job:
    conn: _Conn
    head: bytes  # the request line and headers, without the blank line
    queued_at: float


class _Pool:
    """Up to ``threads`` threads serving whole request heads, started as they are needed; a head
    beyond what they and their queue hold is refused."""

    def __init__(self, name: str, threads: int, queue_size: int, serve: Callable[[_Job], None]) -> None:
        self.name = name
        self.max_threads = threads
        self.queue: queue.Queue[_Job | None] = queue.Queue(queue_size)
        self.serve = serve
        self.threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def offer(self, job: _Job) -> bool:
        with self._lock:
            if self.queue.qsize() + 1 > self._idle and len(self.threads) < self.max_threads:  # no thread for it
                t = threading.Thread(target=self._run, name=f"prefixscope-http-{self.name}-{len(self.threads)}",
                                     daemon=True)
                self.threads.append(t)
                self._idle += 1
                t.start()
        try:
            self.queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            with self._lock:
                self._idle -= 1
            try:
                self.serve(job)
            except Exception:  # a bug in serving one request must not take a thread down
                log.exception("error serving %s", job.conn.addr)
                job.conn.close()
            finally:
                with self._lock:
                    self._idle += 1

    def stop(self, timeout: float) -> None:
        for _ in self.threads:
            with contextlib.suppress(queue.Full):
                self.queue.put_nowait(None)
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _BodyBudget:
    """Request bodies held at once, by their announced length: past it a request gets 503 before
    its body is read, so slow or stalled bodies cannot pile up memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n and self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class _Listener:
    """The listening socket, the loop that reads request heads, and the two pools."""

    def __init__(self, host: str, port: int, routes: RouteTable, deps: ServerDeps) -> None:
        self.routes = routes
        self.read_timeout = deps.read_timeout
        self.head_timeout = min(HEAD_TIMEOUT_S, deps.read_timeout)
        self.max_connections = deps.max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(1024)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.server_address = self.sock.getsockname()
        self.bodies = _BodyBudget(max(BODY_BUDGET_BYTES, 2 * deps.max_body_bytes))
        self.refused = 0  # requests answered 503 because the pools or the body budget were full
        self.evicted = 0  # connections closed to make room before they sent a whole head
        # connections the loop reads heads from, oldest (earliest deadline) first, and by client
        self._waiting: dict[_Conn, None] = {}
        self._by_client: dict[str, dict[_Conn, None]] = {}
        self._returned: list[_Conn] = []  # kept-alive connections handed back by the pools
        self._returned_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._closed = False
        self.scrapes = _Pool("scrape", SCRAPE_THREADS, 64, self._serve)
        self.requests = _Pool("request", self.max_connections, self.max_connections, self._serve)

    # ---- lifecycle --------------------------------------------------------------------------
    def serve_forever(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(POLL_S):
                    if key.fileobj is self.sock:
                        self._accept(sel)
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._readable(sel, key.data)
                self._take_returned(sel)
                self._expire(sel)
        finally:
            for conn in list(self._waiting):
                self._drop(sel, conn)
            sel.close()

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def server_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for pool in (self.scrapes, self.requests):
            pool.stop(timeout=2.0)
        for s in (self.sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()

    # ---- the loop ---------------------------------------------------------------------------
    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # a burst, then back to the connections already waiting
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: make room, try again on the next round
                log.debug("accept failed: %s", exc)
                self._evict_oldest(sel, self._waiting)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # an answer leaves in one write: no Nagle delay
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._wait(sel, _Conn(sock, addr, time.monotonic() + self.head_timeout))

    def _wait(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        mine = self._by_client.setdefault(conn.client, {})
        if len(mine) >= MAX_WAITING_PER_CLIENT:
            self._evict_oldest(sel, mine)
        if len(self._waiting) >= MAX_WAITING:
            self._evict_oldest(sel, self._waiting)
        self._waiting[conn] = None
        self._by_client.setdefault(conn.client, {})[conn] = None
        try:
            sel.register(conn.sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            self._drop(sel, conn)
            return
        if conn.buf:  # a pipelined request arrived with the previous one
            self._parse(sel, conn)

    def _unwait(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        mine = self._by_client.get(conn.client)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._by_client[conn.client]
        with contextlib.suppress(KeyError, ValueError, OSError):
            sel.unregister(conn.sock)

    def _drop(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        self._unwait(sel, conn)
        conn.close()

    def _evict_oldest(self, sel: selectors.BaseSelector, waiting: Mapping[_Conn, None]) -> None:
        oldest = next(iter(waiting), None)
        if oldest is not None:
            self.evicted += 1
            self._drop(sel, oldest)

    def _readable(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, conn)
            return
        conn.buf += data
        self._parse(sel, conn)

    def _parse(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        while conn.buf[:2] == b"\r\n" or conn.buf[:1] == b"\n":  # blank lines before a request are ignored
            del conn.buf[: 2 if conn.buf[:1] == b"\r" else 1]
        end, sep = conn.buf.find(b"\r\n\r\n"), 4
        bare = conn.buf.find(b"\n\n")
        if bare >= 0 and (end < 0 or bare < end):
            end, sep = bare, 2
        if end < 0:
            if len(conn.buf) > MAX_HEAD_BYTES:
                self._refuse(sel, conn, _response_bytes(431, "application/json",
                                                        b'{"status":"error","error":"request head too large"}', {}, True))
            return
        head = bytes(conn.buf[:end])
        del conn.buf[: end + sep]
        self._unwait(sel, conn)
        method, _, rest = head.partition(b" ")
        target = rest.partition(b" ")[0].partition(b"?")[0].rstrip(b"/") or b"/"
        scrape = method in (b"GET", b"HEAD") and target.decode("latin-1") in SCRAPE_PATHS
        pool = self.scrapes if scrape else self.requests
        if not pool.offer(_Job(conn, head, time.monotonic())):
            self.refused += 1
            self._refuse(sel, conn, _busy(f"too many requests in progress ({self.max_connections}); retry shortly"))

    def _refuse(self, sel: selectors.BaseSelector, conn: _Conn, answer: bytes) -> None:
        with contextlib.suppress(OSError):
            conn.sock.send(answer)  # best effort, without waiting: the client may not be reading
        self._drop(sel, conn)

    def _take_returned(self, sel: selectors.BaseSelector) -> None:
        with self._returned_lock:
            back, self._returned = self._returned, []
        now = time.monotonic()
        for conn in back:
            conn.deadline = now + self.head_timeout
            with contextlib.suppress(OSError):
                conn.sock.setblocking(False)
            self._wait(sel, conn)

    def _expire(self, sel: selectors.BaseSelector) -> None:
        # Every connection waits from when it was added, for the same time: the oldest are first.
        now = time.monotonic()
        while self._waiting:
            conn = next(iter(self._waiting))
            if conn.deadline > now:
                return
            log.debug("%s: closed, no whole request head within %gs", conn.addr, self.head_timeout)
            self._drop(sel, conn)

    def _give_back(self, conn: _Conn) -> None:
        if self._stop.is_set():
            conn.close()
            return
        with self._returned_lock:
            self._returned.append(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # ---- one request, on a pool's thread -------------------------------------------------------
    def _serve(self, job: _Job) -> None:
        conn = job.conn
        conn.sock.setblocking(True)
        conn.sock.settimeout(self.read_timeout)
        keep = False
        try:
            keep = self._handle(job)
        except OSError as exc:
            log.debug("%s: connection failed: %s", conn.addr, exc)
        if keep:
            self._give_back(conn)
        else:
            conn.close()

    def _handle(self, job: _Job) -> bool:
        """Answer one request; True when the connection may carry another."""
        conn = job.conn
        try:
            line, _, header_text = job.head.decode("latin-1").partition("\n")
            method, target, version = line.rstrip("\r").split(" ")
            if not version.startswith("HTTP/1."):
                raise ValueError(version)
            headers = http.client.parse_headers(io.BytesIO(header_text.encode("latin-1") + b"\r\n"))
        except (ValueError, http.client.HTTPException) as exc:
            self._send(conn, method="GET", response=error_response(HttpError(f"malformed request: {exc}", 400)), close=True)
            return False
        close = (headers.get("Connection", "").lower() == "close" if version != "HTTP/1.0"
                 else headers.get("Connection", "").lower() != "keep-alive")
        if time.monotonic() - job.queued_at > ADMIT_WAIT_S and \
                not (method in ("GET", "HEAD") and (urlsplit(target).path.rstrip("/") or "/") in SCRAPE_PATHS):
            self.refused += 1
            self._send(conn, method, error_response(HttpError("too many requests in progress; retry shortly",
                                                              503, {"Retry-After": "1"})), close=True)
            return False
        length_header = headers.get("Content-Length")
        announced = int(length_header) if length_header is not None and length_header.isdigit() else 0
        if announced > self.bodies.limit // 2:
            announced = 0  # the route refuses it with 413 before reading (its own limit is lower)
        if not self.bodies.take(announced):
            self.refused += 1
            self._send(conn, method, error_response(HttpError("too many request bodies in progress; retry shortly",
                                                              503, {"Retry-After": "1"})), close=True)
            return False
        try:
            reader = _BodyReader(conn, headers, time.monotonic() + self.read_timeout)
            parts = urlsplit(target)
            path = parts.path.rstrip("/") or "/"
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            req = Request(method, path, query, headers, reader.read, conn.client)
            response = self._route(req)
            if isinstance(response, RequestTimeout):
                self._send(conn, method, error_response(HttpError(
                    f"request body not received within {self.read_timeout:g}s", 408)), close=True)
                return False
            # a body the handler did not read (or a failed request that may carry one): close, so it
            # is not parsed as the next request
            close = close or not reader.consumed or (response.status >= 400 and method not in BODYLESS)
            self._send(conn, method, response, close)
            return not close
        finally:
            self.bodies.give(announced)

    def _route(self, req: Request) -> Response | RequestTimeout:
        try:
            return self.routes.resolve(req.method, req.path)(req)
        except RequestTimeout as exc:
            return exc
        except HttpError as exc:
            log.debug("%s %s: %d %s", req.method, req.path, exc.status, exc.message)
            return error_response(exc)
        except _Closed as exc:
            return error_response(HttpError(str(exc), 400))
        except Exception:  # a bug in one handler must not take the server down
            log.exception("error serving %s %s", req.method, req.path)
            return error_response(HttpError("internal error; see the exporter log", 500))

    @staticmethod
    def _send(conn: _Conn, method: str, response: Response, close: bool) -> None:
        # Status line, headers and body in one write: two writes would leave the body waiting for
        # the client's delayed ACK of the headers (~40 ms a request on a kept-alive connection).
        conn.sock.sendall(_response_bytes(response.status, response.content_type, response.body, response.headers,
                                          close, head_only=method == "HEAD"))


class _BodyReader:
    """A request's body: the bytes read with its head first, then the socket, all within a deadline
    (a per-read timeout alone never fires for a client that drips a byte at a time)."""

    def __init__(self, conn: _Conn, headers: Any, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        length = headers.get("Content-Length")
        self.left = int(length) if length is not None and length.isdigit() else 0
        self.expect_continue = (headers.get("Expect") or "").lower() == "100-continue"

    @property
    def consumed(self) -> bool:
        return self.left == 0

    def read(self, n: int) -> bytes:
        n = min(n, self.left)
        if n <= 0:
            return b""
        if self.expect_continue:
            self.expect_continue = False
            self.conn.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        chunks: list[bytes] = []
        got = 0
        buf = self.conn.buf
        if buf:
            take = bytes(buf[:n])
            del buf[:n]
            chunks.append(take)
            got = len(take)
        while got < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout("request body not received within the read timeout")
            self.conn.sock.settimeout(left)
            try:
                chunk = self.conn.sock.recv(min(n - got, BODY_CHUNK))
            except TimeoutError:
                raise RequestTimeout("request body not received within the read timeout") from None
            if not chunk:
                self.left -= got
                raise _Closed(f"body ended after {got} of {n} bytes")
            chunks.append(chunk)
            got += len(chunk)
        self.left -= got
        return b"".join(chunks)


class ExporterServer:
    """The exporter's HTTP server on ``host:port`` (port 0 picks a free one), served from a thread.

    Bound at construction (OSError if the address is taken). Connections are read by one loop and
    served by two pools (see the notes above ``SCRAPE_PATHS``): ``web.max_connections`` requests at
    once (and as many queued, each for at most ``ADMIT_WAIT_S``; beyond, 503) and, apart from them,
    the scrapes.
    """

    def __init__(self, host: str, port: int, deps: ServerDeps) -> None:
        self.httpd = _Listener(host, port, Endpoints(deps).routes(), deps)
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
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="prefixscope-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.httpd.server_close()


def _state(t: TargetStatus) -> str:
    """A target's state cell: the target's own words when it has them, else up / down / not yet scraped."""
    word = "up" if t.up else "not yet scraped" if t.up is None else "<b>down</b>"
    if t.detail is None:
        return word
    return f"<b>{html.escape(t.detail)}</b>" if t.up is False else html.escape(t.detail)
