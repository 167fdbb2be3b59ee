"""Hostile scrape targets on 127.0.0.1: dripping headers, huge and gzip-bomb bodies, redirects,
bad label values, many targets; a healthy target is never held up by them."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from exporter.core.health import Health
from exporter.model import RouterSnapshot, WorkerSnapshot
from exporter.sources.scrape import Scraper, ScrapeTarget

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PAGE = (FIXTURES / "vllm_0_10_both_names.txt").read_bytes()
CAP = 1 << 20


class Sink:
    def __init__(self, on_worker=None) -> None:
        self.workers: dict[str, WorkerSnapshot] = {}
        self.observed: list[str] = []
        self.on_worker = on_worker

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        self.workers[snapshot.worker] = snapshot
        self.observed.append(snapshot.worker)
        if self.on_worker is not None:
            self.on_worker(snapshot.worker)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None: ...
    def apply_kv_batch(self, batch, received_at) -> None: ...
    def worker_restarted(self, worker) -> None: ...
    def ingest_records(self, records, received_at) -> None: ...


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    release = threading.Event()
    requested: ClassVar[list[str]] = []
    drip_finished = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.strip("/")
        Handler.requested.append(path)
        conn = self.connection
        try:
            if path == "drip_headers":  # one byte of the header block every 0.5 s, for up to a minute
                head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" + b"X-Pad: " + b"a" * 200
                for byte in head:
                    if self.release.wait(0.5):
                        break
                    conn.sendall(bytes([byte]))
                Handler.drip_finished.set()
                return
            if path == "huge_declared":
                return self._head(200, {"Content-Length": str(64 << 20)}, b"x" * 65536)
            if path == "huge_streamed":  # no length: read to the close, past the cap
                self._head(200, {"Connection": "close"}, b"")
                for _ in range(40):
                    conn.sendall(b"# padding line\n" * 4096)
                return
            if path == "gzip_bomb":
                body = gzip.compress(b"#" * (64 << 20), compresslevel=9)
                return self._head(200, {"Content-Encoding": "gzip", "Content-Length": str(len(body))}, body)
            if path == "redirect":
                return self._head(302, {"Location": "/vllm_0_33_dp2.txt", "Content-Length": "0"}, b"")
            if path == "chunked":
                self._head(200, {"Transfer-Encoding": "chunked"}, b"")
                for i in range(0, len(PAGE), 700):
                    part = PAGE[i:i + 700]
                    conn.sendall(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
                conn.sendall(b"0\r\n\r\n")
                return
            if path == "bad_labels":
                body = PAGE + (b'vllm:num_requests_running{engine="1",model_name="\xed\xa0\x80"} 5\n'
                               b'vllm:num_requests_waiting{engine="1",model_name="' + b"m" * 5000 + b'"} 5\n'
                               b'vllm:num_requests_waiting{engine="2",model_name="\\ud800"} 1\n'  # no \\u escapes: fine
                               b'vllm:prefix_cache_hits_total{engine="1"} NaN\n')
                return self._head(200, {"Content-Length": str(len(body))}, body)
            file = FIXTURES / path
            body = file.read_bytes() if file.is_file() else b"not found\n"
            self._head(200 if file.is_file() else 404, {"Content-Length": str(len(body))}, body)
        except OSError:
            pass  # the scraper gave up and closed: expected for the hostile targets

    def _head(self, code: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.flush()
        if body:
            self.connection.sendall(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def handle_error(self, request: object, client_address: object) -> None:
        """A hostile target's connection that the scraper gave up on (reset while this server
        waited for a next request on it) is expected here: no traceback."""


@pytest.fixture()
def base_url() -> Iterator[str]:
    Handler.release = threading.Event()
    Handler.requested = []
    Handler.drip_finished = threading.Event()
    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Handler.release.set()
    server.shutdown()
    server.server_close()


def _errors(health: Health) -> dict:
    return health.snapshot()[0].get("prefixscope_ingest_errors", {})


def test_dripping_headers_do_not_hold_up_a_healthy_target(base_url: str) -> None:
    drip_open_when_healthy_seen: list[bool] = []
    sink = Sink(lambda w: drip_open_when_healthy_seen.append(not Handler.drip_finished.is_set()))
    health = Health()
    targets = [ScrapeTarget("drip", f"{base_url}/drip_headers", "worker"),
               ScrapeTarget("ok", f"{base_url}/vllm_0_33_dp2.txt", "worker")]
    scraper = Scraper(targets, sink, health, timeout=1.0, interval=1.0)  # as the config allows: timeout ≤ interval
    scraper.start()
    try:
        until = time.monotonic() + 30
        while sink.observed.count("ok") < 2 and time.monotonic() < until:
            time.sleep(0.02)
    finally:
        scraper.close()
    # the healthy target was scraped, round after round, while the dripping one was still sending its headers
    assert sink.observed.count("ok") >= 2 and all(drip_open_when_healthy_seen)
    assert scraper.last["drip"].error.startswith("timeout") and "headers" in scraper.last["drip"].error
    assert scraper.last["ok"].up
    assert _errors(health)[("worker_metrics", "timeout")] >= 1


@pytest.mark.parametrize(("path", "kind"), [("huge_declared", "too_large"), ("huge_streamed", "too_large"),
                                            ("gzip_bomb", "too_large"), ("redirect", "redirect")])
def test_oversized_bodies_and_redirects_are_refused(base_url: str, path: str, kind: str) -> None:
    sink, health = Sink(), Health()
    targets = [ScrapeTarget("bad", f"{base_url}/{path}", "worker"), ScrapeTarget("ok", f"{base_url}/chunked", "worker")]
    scraper = Scraper(targets, sink, health, timeout=10.0, max_body_bytes=CAP)
    outcomes = {o.target.name: o for o in scraper.scrape_once()}
    assert not outcomes["bad"].up and outcomes["bad"].error.startswith(kind)
    assert outcomes["ok"].up and sink.workers["ok"].prefix_queried_tokens == 5000.0  # the chunked page
    assert _errors(health) == {("worker_metrics", kind): 1.0}
    assert "vllm_0_33_dp2.txt" not in Handler.requested  # the redirect was not followed


def test_bad_label_values_and_bad_numbers_are_rejected_and_counted(base_url: str) -> None:
    sink, health = Sink(), Health()
    (outcome,) = Scraper([ScrapeTarget("w", f"{base_url}/bad_labels", "worker")], sink, health).scrape_once()
    assert outcome.up
    snap = sink.workers["w"]
    assert snap.running == 2.0 and snap.waiting == 4.0 + 1.0  # the rejected lines are not summed in
    # the NaN drops the current hit counter; vLLM 0.10's equal legacy counter stands in for it
    assert snap.prefix_hit_tokens == 1250.0 and snap.prefix_queried_tokens == 5000.0
    assert _errors(health) == {("worker_metrics", "label_value"): 2.0, ("worker_metrics", "bad_value"): 1.0}


def test_a_thousand_targets_in_one_round(base_url: str) -> None:
    sink, health = Sink(), Health()
    targets = [ScrapeTarget(f"w{i}", f"{base_url}/vllm_0_10_both_names.txt", "worker") for i in range(1000)]
    outcomes = Scraper(targets, sink, health, timeout=60.0).scrape_once()
    assert len(outcomes) == 1000 and all(o.up for o in outcomes)
    assert len(sink.workers) == 1000 and _errors(health) == {}


class KeepAliveHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the connection open between answers
    timeout = 1.0  # an idle connection is closed after this long
    connections: ClassVar[list[int]] = []  # one entry per accepted connection
    served_here: int

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        KeepAliveHandler.connections.append(1)
        self.served_here = 0

    def do_GET(self) -> None:
        self.served_here += 1
        gz = "gzip" in (self.headers.get("Accept-Encoding") or "")
        body = gzip.compress(PAGE) if gz else PAGE
        self.send_response(200)
        if gz:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        if self.path.endswith("/once") and self.served_here >= 1:
            self.send_header("Connection", "close")  # this server closes after each answer
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)


def test_connections_are_kept_between_rounds_and_a_closed_one_is_replaced() -> None:
    KeepAliveHandler.connections.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAliveHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    sink, health = Sink(), Health()
    scraper = Scraper([ScrapeTarget("kept", f"http://127.0.0.1:{port}/metrics", "worker"),
                       ScrapeTarget("closing", f"http://127.0.0.1:{port}/metrics/once", "worker")],
                      sink, health, timeout=5.0)
    try:
        for _ in range(3):
            assert all(o.up for o in scraper.scrape_once())
        # one connection kept for "kept", a new one per round for the target that says close
        assert len(KeepAliveHandler.connections) == 1 + 3
        time.sleep(KeepAliveHandler.timeout + 0.5)  # the server drops its idle connections
        assert all(o.up for o in scraper.scrape_once())  # the closed one is replaced within the round
        assert len(KeepAliveHandler.connections) == 1 + 3 + 2
    finally:
        scraper.close()
        server.shutdown()
        server.server_close()
    assert sink.observed.count("kept") == 4
