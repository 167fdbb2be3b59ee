"""Scraping real HTTP servers on 127.0.0.1 that serve recorded /metrics pages, hang or misbehave."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from exporter.core.health import Health
from exporter.model import RouterSnapshot, WorkerSnapshot
from exporter.sources.scrape import Scraper, ScrapeTarget
from tests.support import free_port, wait_for

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HANG_S = 3.0


class Sink:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerSnapshot] = {}
        self.routers: dict[str, RouterSnapshot] = {}

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        self.workers[snapshot.worker] = snapshot

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        self.routers[snapshot.router] = snapshot

    def apply_kv_batch(self, batch, received_at) -> None: ...
    def worker_restarted(self, worker) -> None: ...
    def ingest_records(self, records, received_at) -> None: ...


class Handler(BaseHTTPRequestHandler):
    release = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.strip("/")
        if path == "hang":
            self.release.wait(HANG_S)
            return self._send(200, b"vllm:num_requests_running 1\n")
        if path == "drip":  # headers at once, then the body too slowly
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(20):
                if self.release.wait(0.1):
                    return
                self.wfile.write(b"#" * 10)
                self.wfile.flush()
            return
        if path == "gzip":  # prometheus_client gzips when the client accepts it
            body = gzip.compress((FIXTURES / "vllm_0_33_dp2.txt").read_bytes())
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None
        if path == "garbage":
            return self._send(200, b"<html><body>502 Bad Gateway</body></html>\n")
        if path == "error":
            return self._send(500, b"internal error\n")
        if path == "partly_broken":
            text = (FIXTURES / "vllm_0_10_both_names.txt").read_bytes()
            return self._send(200, text + b'vllm:num_requests_running{engine="1" 2\n')
        file = FIXTURES / path
        if file.is_file():
            return self._send(200, file.read_bytes())
        return self._send(404, b"not found\n")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def base_url() -> Iterator[str]:
    Handler.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Handler.release.set()
    server.shutdown()
    server.server_close()


def _fields(snap: WorkerSnapshot) -> dict:
    return {f: getattr(snap, f) for f in snap.__slots__}


def test_workers_and_routers_scraped_and_normalised(base_url: str) -> None:
    sink, health = Sink(), Health()
    targets = [ScrapeTarget("w0", f"{base_url}/vllm_0_33_dp2.txt", "worker"),
               ScrapeTarget("w1", f"{base_url}/sglang_cached_counter.txt", "worker"),
               ScrapeTarget("w2", f"{base_url}/gzip", "worker"),
               ScrapeTarget("r0", f"{base_url}/vllm_router_metrics.txt", "router"),
               ScrapeTarget("r1", f"{base_url}/sglang_router_metrics.txt", "router", "sglang-router")]
    scraper = Scraper(targets, sink, health, timeout=2.0)
    try:
        outcomes = scraper.scrape_once()
    finally:
        scraper.close()
    assert [o.up for o in outcomes] == [True] * 5
    assert sink.workers["w0"].prefix_hit_tokens == 26000.0 and sink.workers["w1"].flavour == "sglang"
    assert sink.workers["w2"] == sink.workers["w0"].__class__(**{**_fields(sink.workers["w0"]), "worker": "w2"})
    assert sink.routers["r0"].prefix_outcomes == {"hit": 110.0, "miss": 10.0}
    assert sink.routers["r1"].kind == "sglang-router"
    _, gauges = health.snapshot()
    assert gauges["prefixscope_up"] == {("w0", "worker"): 1.0, ("w1", "worker"): 1.0, ("w2", "worker"): 1.0,
                                        ("r0", "router"): 1.0, ("r1", "router"): 1.0}
    assert all(0 < d < 2 for d in gauges["prefixscope_scrape_duration_seconds"].values())
    assert "prefixscope_ingest_errors" not in health.snapshot()[0]


def test_failures_set_up_zero_count_errors_and_never_raise(base_url: str) -> None:
    sink, health = Sink(), Health()
    targets = [ScrapeTarget("hang", f"{base_url}/hang", "worker"),
               ScrapeTarget("drip", f"{base_url}/drip", "worker"),
               ScrapeTarget("garbage", f"{base_url}/garbage", "worker"),
               ScrapeTarget("error", f"{base_url}/error", "router"),
               ScrapeTarget("refused", f"http://127.0.0.1:{free_port()}/metrics", "worker"),
               ScrapeTarget("wrong_kind", f"{base_url}/vllm_0_33_dp2.txt", "router"),
               ScrapeTarget("ok", f"{base_url}/vllm_0_8_legacy.txt", "worker")]
    scraper = Scraper(targets, sink, health, timeout=0.5, max_workers=8)
    started = time.monotonic()
    try:
        outcomes = {o.target.name: o for o in scraper.scrape_once()}
    finally:
        scraper.close()
    assert time.monotonic() - started < HANG_S - 0.5  # the hanging targets did not hold the round
    assert {n for n, o in outcomes.items() if o.up} == {"ok"}
    assert sink.workers.keys() == {"ok"} and sink.routers == {}
    assert outcomes["hang"].error.startswith("timeout") and outcomes["drip"].error.startswith("timeout")
    counters, gauges = health.snapshot()
    assert counters["prefixscope_ingest_errors"] == {
        ("worker_metrics", "timeout"): 2.0, ("worker_metrics", "garbage"): 1.0,
        ("router_metrics", "http_status"): 1.0, ("worker_metrics", "connect"): 1.0,
        ("router_metrics", "garbage"): 1.0}
    assert gauges["prefixscope_up"][("hang", "worker")] == 0.0
    assert gauges["prefixscope_up"][("error", "router")] == 0.0
    assert gauges["prefixscope_up"][("ok", "worker")] == 1.0


def test_malformed_lines_are_counted_but_the_target_stays_up(base_url: str) -> None:
    sink, health = Sink(), Health()
    scraper = Scraper([ScrapeTarget("w", f"{base_url}/partly_broken", "worker")], sink, health)
    try:
        (outcome,) = scraper.scrape_once()
    finally:
        scraper.close()
    assert outcome.up and sink.workers["w"].prefix_queried_tokens == 5000.0
    assert health.snapshot()[0]["prefixscope_ingest_errors"] == {("worker_metrics", "malformed_line"): 1.0}


def test_background_loop_repeats_and_stops(base_url: str) -> None:
    sink, health = Sink(), Health()
    scraper = Scraper([ScrapeTarget("w", f"{base_url}/vllm_0_33_dp2.txt", "worker")], sink, health, interval=0.05)
    scraper.start()
    try:
        wait_for(lambda: "w" in scraper.last, "a first scrape", every=0.01)
    finally:
        scraper.close()
    assert scraper.last["w"].up and scraper._thread is not None and not scraper._thread.is_alive()


def test_bad_target_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Scraper([ScrapeTarget("x", "http://127.0.0.1:1/", "database")], Sink(), Health())
