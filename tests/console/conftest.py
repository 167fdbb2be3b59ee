"""Console test fixtures: caches cleared between tests, a real exporter HTTP server on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import streamlit as st
import yaml
from prometheus_client import CollectorRegistry

from console.links import GENERATED_RULES
from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from exporter.core.breaches import BreachClock
from exporter.core.prefix_text import PrefixNames
from exporter.core.state import ClusterState
from exporter.web.api import ApiBuilders
from exporter.web.exposition import render_state
from exporter.web.server import ExporterServer, ServerDeps
from prefixscope.catalog import SIGNALS
from tests import servers
from tests.console import backfill, cluster, liveness_cluster, topology_cluster
from tests.support import free_port, require_file


@pytest.fixture(autouse=True)
def _clear_streamlit_caches() -> Iterator[None]:
    # Streamlit caches outlive AppTest instances (streamlit#9139): start and end each test clean.
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


def _serve(state: ClusterState, breaches: BreachClock | None = None,
           names: PrefixNames | None = None) -> Iterator[str]:
    """The exporter's HTTP edge over ``state``: its /api/v1 builders (reading ``breaches``, the
    breach record a test advances, and ``names``, prefix text, if given) and its /metrics text."""
    deps = ServerDeps(registry=CollectorRegistry(), api=ApiBuilders(state, names, breaches=breaches).routes(),
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
    require_file(GENERATED_RULES, "the generated rules (run prefixscope generate)")
    rules = servers.alerts_at_once(yaml.safe_load(GENERATED_RULES.read_text(encoding="utf-8")))
    history = backfill.openmetrics(list(SIGNALS), time.time() - 2)
    with servers.prometheus(tmp_path_factory.mktemp("prometheus"), rules, history,
                            {"PrefixHitRateLow", "PrefixStickyCollisionsHigh"}) as url:
        yield url
