"""The route table and the server's one error path."""

from __future__ import annotations

import json
import logging

import pytest
import requests
from prometheus_client import CollectorRegistry

from exporter.web.routes import (
    BadRequest,
    HttpError,
    Request,
    Response,
    RouteTable,
    error_response,
    json_response,
)
from exporter.web.server import ExporterServer, ServerDeps


def ok(_req: Request) -> Response:
    return Response(200, b"ok", "text/plain")


def table() -> RouteTable:
    return RouteTable().add("GET", "/a", ok).add("POST", "/b", ok, wrong_method_hint="use POST")


def test_resolves_method_and_path_and_head_as_get() -> None:
    t = table()
    assert t.resolve("GET", "/a") is ok and t.resolve("HEAD", "/a") is ok and t.resolve("post", "/b") is ok


def test_unknown_path_is_404() -> None:
    with pytest.raises(HttpError) as info:
        table().resolve("GET", "/nope")
    assert info.value.status == 404 and "/nope" in info.value.message


def test_wrong_method_is_405_with_allow() -> None:
    with pytest.raises(HttpError) as info:
        table().resolve("DELETE", "/a")
    assert (info.value.status, info.value.headers, info.value.message) == (405, {"Allow": "GET"}, "method not allowed")
    with pytest.raises(HttpError) as info:
        table().resolve("GET", "/b")
    assert (info.value.status, info.value.headers["Allow"], info.value.message) == (405, "POST", "use POST")


def test_error_response_shape_and_bad_request_status() -> None:
    r = error_response(BadRequest("k: expected an integer"))
    assert (r.status, r.content_type) == (400, "application/json")
    assert json.loads(r.body) == {"status": "error", "error": "k: expected an integer"}
    assert json.loads(json_response(200, {"v": float("inf")}).body) == {"v": None}  # no value, never 0


@pytest.fixture
def broken_server():
    def boom(_q: object) -> dict:
        raise RuntimeError("a bug")

    srv = ExporterServer("127.0.0.1", 0, ServerDeps(registry=CollectorRegistry(), api={"boom": boom})).start()
    yield srv
    srv.stop()


def test_a_handler_bug_is_one_500_logged_once(broken_server: ExporterServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="prefixscope.server"):
        r = requests.get(broken_server.url + "/api/v1/boom", timeout=5)
    assert r.status_code == 500 and r.json() == {"status": "error", "error": "internal error; see the exporter log"}
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None


def test_over_http_unknown_path_404_wrong_method_405(broken_server: ExporterServer) -> None:
    r = requests.put(broken_server.url + "/nope", data=b"x", timeout=5)
    assert r.status_code == 404 and r.json()["status"] == "error"
    r = requests.put(broken_server.url + "/metrics", data=b"x", timeout=5)
    assert (r.status_code, r.headers["Allow"]) == (405, "GET")
    h = requests.head(broken_server.url + "/healthz", timeout=5)
    assert h.status_code == 200 and h.content == b""
