"""Console test fixtures: caches cleared between tests, a real exporter HTTP server on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import streamlit as st
from prometheus_client import CollectorRegistry

from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from exporter.server import ExporterServer, ServerDeps
from tests.console import payloads


@pytest.fixture(autouse=True)
def _clear_streamlit_caches() -> Iterator[None]:
    # Streamlit caches outlive AppTest instances (streamlit#9139): start and end each test clean.
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


@pytest.fixture
def exporter_url() -> Iterator[str]:
    server = ExporterServer("127.0.0.1", 0, ServerDeps(registry=CollectorRegistry(), api=payloads.API)).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def closed_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def exporter_only(monkeypatch: pytest.MonkeyPatch, exporter_url: str) -> str:
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    return exporter_url
