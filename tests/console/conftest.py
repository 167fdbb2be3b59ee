"""Console test fixtures: caches cleared between tests, a real exporter HTTP server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import streamlit as st
import yaml
from prometheus_client import CollectorRegistry

from console.links import GENERATED_RULES
from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from exporter.core.state import ClusterState
from exporter.web.api import ApiBuilders
from exporter.web.exposition import render_state
from exporter.web.server import ExporterServer, ServerDeps
from prefixscope.catalog import SIGNALS
from tests.console import backfill, cluster, liveness_cluster, topology_cluster
from tests.support import free_port, require_file, require_tool, wait_for

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


@pytest.fixture(autouse=True)
def _clear_streamlit_caches() -> Iterator[None]:
    # Streamlit caches outlive AppTest instances (streamlit#9139): start and end each test clean.
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


def _serve(state: ClusterState) -> Iterator[str]:
    """The exporter's HTTP edge over ``state``: its /api/v1 builders and its /metrics text."""
    deps = ServerDeps(registry=CollectorRegistry(), api=ApiBuilders(state).routes(),
                      render_text=lambda: render_state(state))
    server = ExporterServer("127.0.0.1", 0, deps).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def exporter_url() -> Iterator[str]:
    """The real exporter HTTP server and API builders over a ClusterState fed crafted inputs."""
    yield from _serve(cluster.build_state())


@pytest.fixture
def topology_exporter_url() -> Iterator[str]:
    """The real exporter over a 2-node ClusterState in which a worker leaves (topology_cluster.py)."""
    yield from _serve(topology_cluster.build_state(time.time()))


@pytest.fixture
def liveness_exporter_url() -> Iterator[str]:
    """The real exporter over a cluster with a worker down and one that left the pool (liveness_cluster.py)."""
    yield from _serve(liveness_cluster.build_state())


@pytest.fixture
def closed_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (the port was free a moment ago)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def exporter_only(monkeypatch: pytest.MonkeyPatch, exporter_url: str) -> str:
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    return exporter_url


@pytest.fixture
def topology_only(monkeypatch: pytest.MonkeyPatch, topology_exporter_url: str) -> str:
    monkeypatch.setenv(EXPORTER_ENV, topology_exporter_url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    return topology_exporter_url


@pytest.fixture
def liveness_only(monkeypatch: pytest.MonkeyPatch, liveness_exporter_url: str) -> str:
    monkeypatch.setenv(EXPORTER_ENV, liveness_exporter_url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    return liveness_exporter_url


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Real Prometheus on 127.0.0.1 with the generated rules and a backfilled cluster.

    The generated alerts keep their expressions but get ``for: 0s``: the test cannot wait
    minutes for them, and ``for`` is Prometheus's job, not the console's.
    """
    prometheus, promtool = require_tool(PROMETHEUS), require_tool(PROMTOOL)
    require_file(GENERATED_RULES, "the generated rules (run prefixscope generate)")
    tmp = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load(GENERATED_RULES.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "0s"
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 15s, evaluation_interval: 1s}\nrule_files: [rules.yaml]\n", encoding="utf-8")
    (tmp / "backfill.om").write_text(backfill.openmetrics(list(SIGNALS), time.time() - 2), encoding="utf-8")
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(tmp / "backfill.om"), str(tmp / "data")],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d"],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_alerts(url, {"PrefixHitRateLow", "PrefixStickyCollisionsHigh"}, proc, tmp)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_alerts(url: str, names: set[str], proc: subprocess.Popen, tmp: Path, timeout: float = 120.0) -> None:
    def firing() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-2000:]}")
        alerts = requests.get(f"{url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        if not names <= {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}:
            return False
        # The alerts API can say firing a moment before the ALERTS series that charts read is
        # queryable; wait for both.
        stored = requests.get(f"{url}/api/v1/query", params={"query": 'ALERTS{alertstate="firing"}'},
                              timeout=5).json()["data"]["result"]
        return names <= {s["metric"]["alertname"] for s in stored}

    wait_for(firing, f"alerts {sorted(names)} to fire", timeout, every=0.3,
             ignore=(requests.RequestException, ValueError, KeyError))
