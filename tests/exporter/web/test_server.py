"""The HTTP edge over real sockets: routing, gzip, JSON errors, auth and the body limit."""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Iterator

import pytest
import requests
from prometheus_client import CollectorRegistry, Gauge

from exporter.web.server import BadRequest, ExporterServer, IntakeResult, ServerDeps, TargetStatus

TOKEN = "t0ken"


def count_lines(body: bytes) -> IntakeResult:
    """A tiny intake: a line is valid when it is a JSON object (the real one applies the schema)."""
    accepted, errors = 0, []
    for n, line in enumerate(body.splitlines(), 1):
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError:
            ok = False
        if ok:
            accepted += 1
        else:
            errors.append({"line": n, "error": "not a JSON object"})
    return IntakeResult(accepted, len(errors), errors)


def groups(query: dict[str, str]) -> dict:
    if "k" in query and not query["k"].isdigit():
        raise BadRequest("k: expected an integer")
    return {"value": float("nan"), "k": query.get("k")}


@pytest.fixture
def server() -> Iterator[ExporterServer]:
    registry = CollectorRegistry()
    Gauge("prefixscope_test_value", "A test gauge.", registry=registry).set(7)
    deps = ServerDeps(
        registry=registry, api={"groups": groups}, ingest_ndjson=count_lines, bearer_token=TOKEN,
        max_body_bytes=200,
        targets=lambda: [TargetStatus("w0", "worker", "http://127.0.0.1:1/metrics", False),
                         TargetStatus("w<1>", "worker", "http://127.0.0.1:2/metrics", None)],
    )
    srv = ExporterServer("127.0.0.1", 0, deps).start()
    yield srv
    srv.stop()


def post(srv: ExporterServer, body: bytes, token: str | None = TOKEN) -> requests.Response:
    headers = {"Content-Type": "application/x-ndjson"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(srv.url + "/api/v1/records", data=body, headers=headers, timeout=5)


def test_metrics_plain_and_gzip(server: ExporterServer) -> None:
    plain = requests.get(server.url + "/metrics", headers={"Accept-Encoding": "identity"}, timeout=5)
    assert plain.status_code == 200 and plain.headers["Content-Type"].startswith("text/plain")
    assert "prefixscope_test_value 7.0" in plain.text
    raw = requests.get(server.url + "/metrics", headers={"Accept-Encoding": "gzip"}, timeout=5, stream=True)
    assert raw.headers["Content-Encoding"] == "gzip"
    assert b"prefixscope_test_value 7.0" in gzip.decompress(raw.raw.read())


def test_landing_page_lists_endpoints_and_targets(server: ExporterServer) -> None:
    r = requests.get(server.url + "/", timeout=5)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html")
    for link in ("/metrics", "/healthz", "/api/v1/groups", "/api/v1/catalog", "POST /api/v1/records"):
        assert link in r.text
    assert "<b>down</b>" in r.text and "not yet scraped" in r.text
    assert "w&lt;1&gt;" in r.text  # target names are escaped


def test_api_wraps_data_and_maps_nan_to_null(server: ExporterServer) -> None:
    r = requests.get(server.url + "/api/v1/groups?k=3", timeout=5)
    assert r.json() == {"status": "ok", "data": {"value": None, "k": "3"}}
    bad = requests.get(server.url + "/api/v1/groups?k=x", timeout=5)
    assert (bad.status_code, bad.json()) == (400, {"status": "error", "error": "k: expected an integer"})
    cat = requests.get(server.url + "/api/v1/catalog", timeout=5).json()["data"]
    assert cat["namespace"] == "prefixscope" and cat["checks"]


def test_unknown_paths_and_methods_get_json_errors(server: ExporterServer) -> None:
    r = requests.get(server.url + "/nope", timeout=5)
    assert r.status_code == 404 and r.json()["status"] == "error"
    r = requests.get(server.url + "/api/v1/records", timeout=5)
    assert (r.status_code, r.headers["Allow"]) == (405, "POST")
    r = requests.post(server.url + "/metrics", data=b"x", timeout=5)
    assert r.status_code == 405 and r.json()["error"] == "method not allowed"
    r = requests.delete(server.url + "/api/v1/groups", timeout=5)
    assert r.status_code == 405
    assert requests.get(server.url + "/healthz", timeout=5).json()["status"] == "ok"


def test_records_keep_valid_lines_and_report_bad_ones(server: ExporterServer) -> None:
    r = post(server, b'{"a": 1}\nnot json\n{"b": 2}\n')
    assert r.status_code == 400  # the bad line is the sender's to fix; the good ones are kept and counted
    assert r.json()["data"] == {"accepted": 2, "rejected": 1, "errors": [{"line": 2, "error": "not a JSON object"}]}
    r = post(server, b"garbage\n[1]\n")
    assert r.status_code == 400 and r.json()["data"]["accepted"] == 0


def test_records_auth_and_size_limit(server: ExporterServer) -> None:
    assert post(server, b'{"a": 1}\n', token=None).status_code == 401
    r = post(server, b'{"a": 1}\n', token="wrong")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    r = post(server, b'{"a": 1}\n' * 40)  # 360 bytes > 200
    assert r.status_code == 413 and "exceeds the limit of 200 bytes" in r.json()["error"]


def test_missing_content_length_is_411(server: ExporterServer) -> None:
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(f"POST /api/v1/records HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        assert s.recv(200).startswith(b"HTTP/1.1 411")


def test_text_renderer_serves_plain_text_and_registry_serves_openmetrics() -> None:
    registry = CollectorRegistry()
    Gauge("prefixscope_test_value", "A test gauge.", registry=registry).set(7)
    fast = b"# HELP prefixscope_test_value A test gauge.\n# TYPE prefixscope_test_value gauge\nprefixscope_test_value 7.0\n"
    srv = ExporterServer("127.0.0.1", 0, ServerDeps(registry=registry, api={}, render_text=lambda: fast)).start()
    try:
        assert requests.get(srv.url + "/metrics", timeout=5).content == fast
        om = requests.get(srv.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=5)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
    finally:
        srv.stop()


def test_intake_disabled_answers_404() -> None:
    srv = ExporterServer("127.0.0.1", 0, ServerDeps(registry=CollectorRegistry(), api={})).start()
    try:
        r = requests.post(srv.url + "/api/v1/records", data=b"{}\n", timeout=5)
        assert r.status_code == 404 and "disabled" in r.json()["error"]
    finally:
        srv.stop()


def test_an_answer_is_one_write_on_a_socket_without_nagle(server: ExporterServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Headers and body written apart, with Nagle's algorithm on, leave the body waiting for the
    # client's delayed ACK: ~40 ms for every request on a kept-alive connection. Every answer
    # (metrics, API, healthz, an error) must leave in one write on a TCP_NODELAY socket.
    writes: list[tuple[int, bytes]] = []
    real_sendall = socket.socket.sendall

    def sendall(sock: socket.socket, data: bytes, *args: object) -> None:
        writes.append((sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), bytes(data)))
        real_sendall(sock, data, *args)

    monkeypatch.setattr(socket.socket, "sendall", sendall)
    with socket.create_connection(server.address, timeout=5) as conn:
        reader = conn.makefile("rb")
        for path in ("/metrics", "/healthz", "/api/v1/groups?k=3", "/nope", "/healthz"):
            conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status = reader.readline()
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
            assert status.startswith(b"HTTP/1.1 ")
    monkeypatch.undo()
    served = [(nodelay, data) for nodelay, data in writes if not data.startswith(b"GET ")]  # not the client's
    answers = [data for _, data in served if data.startswith(b"HTTP/1.1 ")]
    assert len(answers) == 5 and len(served) == 5, [d[:40] for _, d in served]
    assert all(nodelay for nodelay, _ in served)
    assert all(b"\r\n\r\n" in data and not data.endswith(b"\r\n\r\n") for data in answers)  # body included
