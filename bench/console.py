"""The console's Diagnosis page: how long it takes to render, cold and warm.

The page is what the on-call person opens first, so its budget is strict: under 3 s with nothing
cached (the first visit, or **Refresh now**) and under 1 s on a warm cache (another visit within
the cache's 15 s), on the 2-core machine. The timed path is the page's whole script under
Streamlit's ``AppTest`` — every query to the exporter and Prometheus (side by side: one
refresh waits for the slowest query, not for their sum), the chain, the culprits, the runbook
step and the charts of the checks that fire — against a real exporter HTTP server over a cluster
of ``WORKERS`` workers whose sticky sessions collide (step 2 fires: culprits and charts render)
and, when Prometheus is installed, a real Prometheus that scrapes it with the generated rules.
With Prometheus, traffic keeps arriving while it scrapes (its rates need counters that move).
Each row is the median of ``REPEATS`` renders; "cold" clears Streamlit's caches before each.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
import streamlit as st
import yaml
from prometheus_client import CollectorRegistry
from streamlit.testing.v1 import AppTest

from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from exporter.bootstrap import bootstrap
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, WorkerSnapshot
from exporter.web.api import ApiBuilders
from exporter.web.collector import PrefixscopeCollector
from exporter.web.exposition import render_state
from exporter.web.server import ExporterServer, ServerDeps
from prefixscope.thresholds import load_thresholds

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "console" / "streamlit_app.py")
RULES = ROOT / "alerts" / "generated" / "prefixscope.rules.yaml"
WORKERS = 8
SESSIONS = 400
REPEATS = 5
COLD_TARGET_S = 3.0
WARM_TARGET_S = 1.0


NAMES = [f"w{i}" for i in range(WORKERS)]
SHARED = [0x5EED_0000_0000_0000 + i for i in range(8)]
CHAIN = [*SHARED, 0x1000_0000 + 1, 0x1000_0000 + 2]


def build_state(now: float) -> ClusterState:
    """Eight workers with a shared system prompt and their own branches; keyed sessions whose
    follow-ups come back on another worker one time in five (step 2 fires)."""
    state = bootstrap(thresholds=load_thresholds(), clock=time.time).state
    for i, w in enumerate(NAMES):
        own = [0x1000_0000 * (i + 1) + j for j in range(64)]
        state.apply_kv_batch(KvBatch(w, 0, now - 60, (BlockStored(tuple(SHARED + own), None, 16),)), now - 60)
    traffic(state, now - 100, 0, SESSIONS)
    state.refresh_tree_stats()
    return state


def traffic(state: ClusterState, at: float, first: int, n: int, seq: int = 1) -> None:
    """``n`` new sessions from number ``first``: a first turn at ``at``, a follow-up 50 s later that
    lands on another worker one time in five; the workers' hit counters grow and they send KV events."""
    turns = [{"ts": at + i * 0.1, "request_id": f"a{k}", "worker": NAMES[k % WORKERS], "model": "m",
              "prompt_tokens": 160, "session_key": f"s{k}", "block_hashes": CHAIN, "cached_tokens": 128}
             for i, k in enumerate(range(first, first + n))]
    again = [{**r, "ts": r["ts"] + 50, "request_id": f"b{k}", "worker": NAMES[(k + (k % 5 == 0)) % WORKERS],
              "cached_tokens": 64 if k % 5 == 0 else 160} for k, r in zip(range(first, first + n), turns, strict=True)]
    state.ingest_records(turns, at + n * 0.1)
    state.ingest_records(again, at + 50 + n * 0.1)
    done = first + n
    for i, w in enumerate(NAMES):
        state.observe_worker(WorkerSnapshot(w, "vllm", model="m", prefix_queried_tokens=600.0 * done,
                                            prefix_hit_tokens=300.0 * done, num_gpu_blocks=4096, block_size=16),
                             at + 50)
        state.apply_kv_batch(KvBatch(w, seq, at + 50, (BlockStored((0x7000_0000 + 1000 * seq + i,), None, 16),)),
                             at + 50)


@contextmanager
def live(state: ClusterState) -> Iterator[None]:
    """Traffic keeps arriving (every second, as records and scrapes do) while Prometheus scrapes:
    its rates need counters that move."""
    stop = threading.Event()

    def feed() -> None:
        k, seq = SESSIONS, 2
        while not stop.wait(1.0):
            traffic(state, time.time() - 50, k, 20, seq)
            k, seq = k + 20, seq + 1

    thread = threading.Thread(target=feed, name="bench-traffic", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


@contextmanager
def exporter(state: ClusterState) -> Iterator[str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PrefixscopeCollector(state))  # what Prometheus reads (it asks for OpenMetrics)
    deps = ServerDeps(registry=registry, api=ApiBuilders(state).routes(), render_text=lambda: render_state(state))
    server = ExporterServer("127.0.0.1", 0, deps).start()
    try:
        yield server.url
    finally:
        server.stop()


@contextmanager
def prometheus(exporter_url: str) -> Iterator[str | None]:
    """Prometheus scraping the exporter every second with the generated rules; None when absent."""
    binary = shutil.which("prometheus")
    if binary is None or not RULES.is_file():
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "prefixscope",
                                "static_configs": [{"targets": [exporter_url.removeprefix("http://")]}]}]}))
        port = free_port()
        proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the rules have evaluated over a few scrapes
                try:
                    got = requests.get(f"{url}/api/v1/query", timeout=2, params={
                        "query": "cluster:prefixscope_sticky_collisions_per_followup_requests:ratio_rate5m"}).json()
                    if got["data"]["result"]:
                        break
                except (requests.RequestException, ValueError, KeyError):
                    pass
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render_s(at: AppTest, cold: bool) -> float:
    """One visit of the page: its script run once more in the same app (a browser's refresh).
    The app is made once per source: ``AppTest`` scans the installed packages for components at
    its first run, which a real console server does once at start, not per visit."""
    if cold:
        st.cache_data.clear()
        st.cache_resource.clear()
    started = time.perf_counter()
    at.run()
    took = time.perf_counter() - started
    if at.exception:
        raise RuntimeError(f"the Diagnosis page failed: {at.exception}")
    # The page measured must be the page with its data: step 2 past its limit, no source missing.
    notes = [w.value for w in at.warning if "unavailable" in w.value or "not configured" in w.value]
    top = [m.value for m in (*at.error, *at.warning) if "Verdict: step 2" in m.value]
    if not top or (os.environ.get(PROMETHEUS_ENV) and notes):
        shown = [m.value[:160] for m in (*at.error, *at.warning, *at.success)]
        raise RuntimeError(f"the Diagnosis page did not show step 2 from its sources: {notes or shown}")
    return took


def _rows(source: str) -> list[dict[str, Any]]:
    at = AppTest.from_file(APP, default_timeout=60)
    render_s(at, cold=True)  # imports, component discovery and first connections: not a visit's cost
    cold = statistics.median(render_s(at, cold=True) for _ in range(REPEATS))
    warm = statistics.median(render_s(at, cold=False) for _ in range(REPEATS))
    return [
        {"name": f"console Diagnosis page render, cold cache, {source} (s)", "value": cold,
         "target": f"< {COLD_TARGET_S:g} s", "ok": cold < COLD_TARGET_S},
        {"name": f"console Diagnosis page render, warm cache, {source} (s)", "value": warm,
         "target": f"< {WARM_TARGET_S:g} s", "ok": warm < WARM_TARGET_S},
    ]


def run() -> list[dict[str, Any]]:
    saved = {k: os.environ.get(k) for k in (EXPORTER_ENV, PROMETHEUS_ENV)}
    rows: list[dict[str, Any]] = []
    try:
        state = build_state(time.time())
        with exporter(state) as exp:
            os.environ[EXPORTER_ENV] = exp
            os.environ.pop(PROMETHEUS_ENV, None)
            rows += _rows("exporter only")
            with live(state), prometheus(exp) as prom:
                if prom is None:
                    rows.append({"name": "console Diagnosis page with Prometheus (prometheus not installed)",
                                 "ok": False})
                else:
                    os.environ[PROMETHEUS_ENV] = prom
                    rows += _rows("with Prometheus")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        st.cache_data.clear()
        st.cache_resource.clear()
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
