"""The engines' own histograms, end to end: vLLM's sampled block residency (``--kv-cache-metrics``) and
LMCache's times and lookups, served by real HTTP servers on 127.0.0.1 from pages rendered the way the
peers declare them (tests/fixtures/make_worker_metrics.py), scraped by the exporter built as
``prefixscope export`` builds it, and read back from its own /metrics and API.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from exporter.bootstrap import ExporterParts, bootstrap
from exporter.config import Config, WorkerTarget
from exporter.web.api import ApiBuilders
from exporter.web.exposition import render_state
from exporter.web.server import ExporterServer, ServerDeps

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RESIDENCY = "vllm_0_14_kv_residency"  # vLLM with --kv-cache-metrics, two DP engines
LMCACHE = "lmcache_0353be8"  # vLLM with LMCache as its KV connector
PLAIN = "vllm_0_33_dp2"  # vLLM without the flag and without LMCache


class Pages(BaseHTTPRequestHandler):
    """Serves ``/<fixture>``: the fixture's ``_start`` page (the engine before any eviction or
    LMCache operation) until ``served`` is set, then the page after them."""

    served = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.strip("/")
        start = FIXTURES / f"{name}_start.txt"
        page = start if start.is_file() and not self.served.is_set() else FIXTURES / f"{name}.txt"
        body = page.read_bytes() if page.is_file() else b"not found\n"
        self.send_response(200 if page.is_file() else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def engines() -> Iterator[str]:
    Pages.served = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class Exported:
    """The exporter's parts and its HTTP server (/metrics and the API), as ``prefixscope export`` serves them."""

    def __init__(self, parts: ExporterParts) -> None:
        self.parts = parts
        deps = ServerDeps(registry=CollectorRegistry(), api=ApiBuilders(parts.state).routes(),
                          render_text=lambda: render_state(parts.state))
        self.server = ExporterServer("127.0.0.1", 0, deps).start()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = requests.get(f"{self.server.url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def api(self, path: str) -> dict:
        return requests.get(f"{self.server.url}/api/v1/{path}", timeout=10).json()["data"]


@contextmanager
def scraped(base: str, fixtures: dict[str, str]) -> Iterator[Exported]:
    """The exporter over ``fixtures`` (worker -> fixture), scraped at start and again a minute later,
    once the engines have served."""
    now = [1000.0]
    cfg = Config(workers=tuple(WorkerTarget(w, metrics_url=f"{base}/{f}") for w, f in fixtures.items()))
    parts = bootstrap(cfg, clock=lambda: now[0], with_sources=True)
    assert parts.sources is not None
    scraper = parts.sources.scraper
    exported = Exported(parts)
    try:
        assert all(o.up for o in scraper.scrape_once())
        Pages.served.set()
        now[0] += 60.0
        assert all(o.up for o in scraper.scrape_once())
        yield exported
    finally:
        exported.server.stop()
        scraper.close()


def _bucket(samples: dict, name: str, le: str, **labels: str) -> float:
    return samples[(f"{name}_bucket", tuple(sorted({**labels, "le": le}.items())))]


def test_vllm_residency_is_exported_per_worker_and_a_short_retention_fires(engines: str) -> None:
    with scraped(engines, {"w0": RESIDENCY, "w1": PLAIN}) as exported:
        s = exported.samples()
        # The seven sampled evictions of both engines, on the catalogue's bounds (all of them vLLM's):
        # lifetimes 4, 8, 12, 45, 90 (engine 0) and 6, 25 (engine 1).
        life = "prefixscope_kv_block_lifetime_seconds"
        assert [_bucket(s, life, le, worker="w0") for le in ("1.0", "5.0", "10.0", "30.0", "60.0", "120.0", "+Inf")] \
            == [0, 1, 3, 5, 6, 7, 7]
        idle = "prefixscope_kv_block_idle_before_evict_seconds"  # 2, 3, 4, 8, 20 and 3, 15
        assert [_bucket(s, idle, le, worker="w0") for le in ("1.0", "5.0", "10.0", "30.0", "+Inf")] == [0, 4, 5, 7, 7]
        gap = "prefixscope_kv_block_reuse_gap_seconds"  # 1.5, 2.5, 2, 20, 35, 30 and 8
        assert [_bucket(s, gap, le, worker="w0") for le in ("1.0", "5.0", "10.0", "30.0", "60.0", "+Inf")] \
            == [0, 3, 4, 6, 7, 7]
        assert s[(f"{life}_count", (("worker", "w0"),))] == 7
        # the worker without the flag has none of these series: missing, never zero
        assert not [k for k in s if k[0].startswith("prefixscope_kv_block_") and ("worker", "w1") in k[1]
                    and "eviction_age" not in k[0]]
        assert s[("prefixscope_signal_available", (("signal", "kv_residency"),))] == 1
        # Half of the evicted blocks had sat untouched for at most 4.5 s (interpolated in (1, 5]), under
        # the 30 s threshold: the cache keeps an untouched prefix for seconds.
        [check] = [c for step in exported.api("groups")["steps"] for c in step["checks"]
                   if c["key"] == "prefix_cache_retention"]
        assert check["status"] == "firing" and check["value"] == pytest.approx(4.5)
        [w0] = [w for w in exported.api("workers")["workers"] if w["worker"] == "w0"]
        assert w0["residency_p50_s"]["idle_before_evict"] == pytest.approx(4.5)


def test_without_the_flag_the_retention_check_is_not_instrumented(engines: str) -> None:
    with scraped(engines, {"w0": PLAIN}) as exported:
        s = exported.samples()
        assert s[("prefixscope_signal_available", (("signal", "kv_residency"),))] == 0
        assert not [k for k in s if k[0].startswith(("prefixscope_kv_block_lifetime", "prefixscope_kv_block_idle",
                                                     "prefixscope_kv_block_reuse", "prefixscope_lmcache_"))]
        [check] = [c for step in exported.api("groups")["steps"] for c in step["checks"]
                   if c["key"] == "prefix_cache_retention"]
        assert check["status"] == "not_instrumented" and check["missing_signals"] == ["kv_residency"]
        assert check["value"] is None
        [w0] = exported.api("workers")["workers"]
        assert w0["residency_p50_s"] is None and w0["lmcache_seconds_p50"] is None
        assert w0["lmcache_lookup_queried_tokens"] is None


def test_lmcache_times_and_lookups_are_exported_per_worker(engines: str) -> None:
    with scraped(engines, {"w0": LMCACHE, "w1": PLAIN}) as exported:
        s = exported.samples()
        op = "prefixscope_lmcache_operation_seconds"
        # retrieves of 3 ms, 12 ms, 200 ms; stores of 20 and 50 ms; lookups of 30 µs, 200 µs and 4 ms
        assert [_bucket(s, op, le, worker="w0", operation="retrieve") for le in ("0.001", "0.005", "0.02", "0.25", "+Inf")] \
            == [0, 1, 2, 3, 3]
        assert [_bucket(s, op, le, worker="w0", operation="store") for le in ("0.01", "0.02", "0.08", "+Inf")] \
            == [0, 1, 2, 2]
        assert [_bucket(s, op, le, worker="w0", operation="lookup") for le in ("1e-05", "0.0001", "0.0005", "+Inf")] \
            == [0, 1, 2, 3]
        model = "meta-llama/Llama-3.1-8B-Instruct"
        key = (("model", model), ("worker", "w0"))
        assert s[("prefixscope_lmcache_lookup_queried_tokens_total", key)] == 1000
        assert s[("prefixscope_lmcache_lookup_hit_tokens_total", key)] == 400
        # its retrieve hits stand in for the external prefix cache vLLM itself does not report here
        assert s[("prefixscope_external_prefix_cache_hit_tokens_total", key)] == 320
        assert not [k for k in s if k[0].startswith("prefixscope_lmcache_") and ("worker", "w1") in k[1]]
        rows = {w["worker"]: w for w in exported.api("workers")["workers"]}
        w0 = rows["w0"]
        assert (w0["lmcache_lookup_queried_tokens"], w0["lmcache_lookup_hit_tokens"]) == (1000, 400)
        assert set(w0["lmcache_seconds_p99"]) == {"retrieve", "store", "lookup"}
        assert 0.1 < w0["lmcache_seconds_p99"]["retrieve"] <= 0.25
        assert rows["w1"]["lmcache_seconds_p99"] is None and rows["w1"]["lmcache_lookup_hit_tokens"] is None
