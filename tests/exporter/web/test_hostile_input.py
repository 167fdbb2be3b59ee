"""Hostile input against a running exporter (HTTP on 127.0.0.1, settings from a config file).

Every case here broke the exporter before: a record whose label the exposition cannot encode
failed every later scrape; records naming unbounded models, segments or workers grew /metrics
and memory without limit; nested, huge or float-for-integer values answered 500 and lost the
good lines of the body; idle or half-sent connections held a thread (and their announced body)
each without limit.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from exporter.config import load_config
from exporter.core.sessions import SessionTable
from exporter.main import Runtime
from exporter.sources.records import SLICE_RECORDS, deliver, parse_ndjson

T0 = time.time() - 10  # records of now (inside the window); moved to each test's start below


@pytest.fixture(autouse=True)
def _records_of_now() -> None:
    global T0
    T0 = time.time() - 10


def record(i: int = 0, **kw: object) -> dict:
    return {"ts": T0 + i, "request_id": f"r{i}", "worker": "w0", "prompt_tokens": 10, **kw}


def ndjson(*recs: dict | bytes) -> bytes:
    return b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in recs) + b"\n"


def start(tmp_path: Path, yaml: str = "", clock: Callable[[], float] = time.time) -> Runtime:
    cfg_file = tmp_path / "exporter.yaml"
    cfg_file.write_text(yaml)
    cfg = load_config(cfg_file).with_overrides(listen_address="127.0.0.1:0")
    return Runtime.build(cfg, clock=clock).start()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[[str], Runtime]]:
    """Start an exporter from a config file's text; stopped after the test."""
    started: list[Runtime] = []

    def make(yaml: str = "") -> Runtime:
        started.append(start(tmp_path, yaml))
        return started[-1]

    yield make
    for rt in started:
        rt.stop()


@pytest.fixture
def exporter(make: Callable[[str], Runtime]) -> Runtime:
    return make("")


def post(rt: Runtime, body: bytes) -> requests.Response:
    return requests.post(rt.url + "/api/v1/records", data=body, timeout=10)


def scrape(rt: Runtime) -> str:
    r = requests.get(rt.url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text[:300]
    return r.text


def errors_of(text: str, kind: str) -> float:
    m = re.search(rf'prefixscope_ingest_errors_total\{{kind="{kind}",source="records"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def label_values(text: str, metric: str, label: str) -> set[str]:
    return set(re.findall(rf'^{metric}\{{[^}}]*{label}="([^"]*)"', text, re.M))


def prompt_tokens(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^prefixscope_request_prompt_tokens_total\{[^}]*\} (\S+)", text, re.M))


# ---- labels the exposition cannot encode ----------------------------------------------------------
@pytest.mark.parametrize("line", [
    json.dumps(record(1, model="\ud800")).encode(),  # a "\ud800" escape
    json.dumps(record(1, segment="\udfff", session_key="s")).encode(),
    json.dumps(record(1, model="m")).encode().replace(b'"m"', b'"\xed\xa0\x80"'),  # raw bytes ED A0 80
    json.dumps(record(1, worker="w\ud83d")).encode(),
])
def test_a_label_with_a_lone_surrogate_is_rejected_and_scrapes_keep_working(exporter: Runtime, line: bytes) -> None:
    r = post(exporter, ndjson(record(0, model="good"), line, record(2, model="good")))
    assert r.status_code == 400
    data = r.json()["data"]
    assert (data["accepted"], data["rejected"]) == (2, 1)
    assert data["errors"][0]["line"] == 2 and "UTF-8" in data["errors"][0]["error"]
    for _ in range(2):
        text = scrape(exporter)
    assert errors_of(text, "value") == 1
    assert prompt_tokens(text) == 20  # the two good lines


# ---- bodies that crashed the handler ----------------------------------------------------------------
@pytest.mark.parametrize(("line", "needle"), [
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested"),  # RecursionError in the parser
    (b"[" * 100_000, "nested"),
    (json.dumps(record(1, extra=[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]])).encode(), "nested"),
    (json.dumps(record(1, prompt_tokens=10**300)).encode(), "exceeds"),  # OverflowError in the sums
    (json.dumps(record(1, ts=10**300)).encode(), "exceeds"),
    (json.dumps(record(1, prefill_s=1)).encode().replace(b"1}", b"1e400}"), "not a finite"),
    (json.dumps(record(1, cached_tokens=16.0, block_hashes=[1, 2], block_size=16)).encode(), "integer"),
    (json.dumps(record(1, block_hashes=[1, 2.0])).encode(), "integer"),
])
def test_bad_values_are_rejected_per_line_and_the_rest_is_applied(exporter: Runtime, line: bytes, needle: str) -> None:
    r = post(exporter, ndjson(record(0), line, record(2)))
    assert r.status_code == 400, r.text[:300]
    body = r.json()
    assert "2 record(s) accepted" in body["error"]
    assert body["data"]["accepted"] == 2 and body["data"]["errors"][0]["line"] == 2
    assert needle in body["data"]["errors"][0]["error"]
    text = scrape(exporter)
    assert prompt_tokens(text) == 20
    # 1e400 is a non-finite number (its own kind); the others are malformed JSON or bad values
    assert errors_of(text, "json") + errors_of(text, "value") + errors_of(text, "non_finite") == 1


def test_half_applied_float_count_leaves_no_trace(exporter: Runtime) -> None:
    """cached_tokens 16.0 used to raise after some series were already incremented."""
    post(exporter, ndjson(record(0, cached_tokens=16.0, block_hashes=[1, 2], block_size=16, model="m")))
    text = scrape(exporter)
    assert label_values(text, "prefixscope_request_prompt_tokens_total", "model") == set()


def test_a_large_body_is_applied_in_slices() -> None:
    calls: list[int] = []

    class Sink:
        def ingest_records(self, recs: list, _received_at: float) -> None:
            calls.append(len(recs))

    from exporter.core.health import Health
    recs, errors = parse_ndjson(ndjson(*(record(i) for i in range(SLICE_RECORDS * 3 + 7))), 1 << 24)
    deliver(recs, errors, Sink(), Health(), "http", T0)  # type: ignore[arg-type]
    assert calls == [SLICE_RECORDS] * 3 + [7]


# ---- cardinality ---------------------------------------------------------------------------------------
def test_label_values_beyond_the_limits_fold_into_other(make: Callable[[str], Runtime]) -> None:
    exporter = make("limits: {models: 3, segments: 2, workers: 4}\nworkers: [{name: configured, metrics_url: 'http://127.0.0.1:9/metrics'}]\n")
    recs = [record(i, model=f"m{i}", segment=f"s{i}", session_key=f"k{i}", worker=f"w{i}") for i in range(50)]
    recs.append(record(60, worker="configured"))
    r = post(exporter, ndjson(*recs))
    assert r.status_code == 200
    text = scrape(exporter)
    assert label_values(text, "prefixscope_request_prompt_tokens_total", "model") == {"m0", "m1", "m2", "other", "unknown"}
    assert label_values(text, "prefixscope_session_rekeys_total", "segment") == {"s0", "s1", "other"}
    assert prompt_tokens(text) == 510  # nothing lost: the rest is counted under "other"
    assert set(exporter.state.worker_pool.workers) == {"w0", "w1", "w2", "w3", "other", "configured"}  # configured: pinned
    assert errors_of(text, "label_limit") > 0


def test_series_of_values_gone_for_the_idle_time_are_dropped(tmp_path: Path) -> None:
    now = [T0 + 10]  # the exporter's clock, moved by the test (records never move it)
    exporter = start(tmp_path, "window: 60s\nlimits: {models: 2, label_idle: 60s}\n", clock=lambda: now[0])
    try:
        post(exporter, ndjson(record(0, model="old-a"), record(1, model="old-b")))
        assert label_values(scrape(exporter), "prefixscope_request_prompt_tokens_total", "model") == {"old-a", "old-b"}
        # time moves on; old-a and old-b are not seen again, so their slots and series go
        now[0] += 200
        post(exporter, ndjson(record(210, model="new")))
        text = scrape(exporter)
        assert label_values(text, "prefixscope_request_prompt_tokens_total", "model") == {"new"}
    finally:
        exporter.stop()


def test_many_record_workers_do_not_grow_the_pool(tmp_path: Path) -> None:
    rt = start(tmp_path, "limits: {workers: 50}\n")
    try:
        for batch in range(5):
            post(rt, ndjson(*(record(batch * 1000 + i, worker=f"w{batch}-{i}") for i in range(1000))))
        assert len(rt.state.worker_pool.workers) <= 51
        scrape(rt)
    finally:
        rt.stop()


def test_a_session_with_a_long_chain_costs_under_a_kilobyte() -> None:
    import random
    rng = random.Random(3)
    system = [rng.getrandbits(63) for _ in range(8)]
    table, keys, n = SessionTable(), [f"session-{i:06d}" for i in range(2000)], 2000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            chain = tuple(system + [rng.getrandbits(63) for _ in range(504)])
            table.observe(keys[i], 100.0 + i, "w0", chain[:300], "web", 0)
            table.observe(keys[i], 101.0 + i, "w0", chain, "web", 0)
            del chain
        per_session = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_session <= 1024, per_session
    assert table.shared_depth == 8


# ---- the HTTP edge ---------------------------------------------------------------------------------------
def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_slow_client_is_dropped_after_the_read_timeout(make: Callable[[str], Runtime]) -> None:
    exporter = make("web: {read_timeout: 500ms}\n")
    host, port = exporter.server.address
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        started = time.monotonic()
        assert read_all(s) == b""  # closed without an answer
        assert time.monotonic() - started < 9
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /api/v1/records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        assert read_all(s).startswith(b"HTTP/1.1 408")
    scrape(exporter)


def test_requests_beyond_the_pool_get_503_scrapes_do_not_and_the_exporter_recovers(
        make: Callable[[str], Runtime]) -> None:
    exporter = make("web: {max_connections: 3, read_timeout: 30s}\n")
    host, port = exporter.server.address
    stalled = []  # each holds a request thread, or a place in the queue: its body never finishes
    for _ in range(10):  # three served, three queued, the rest refused
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(b"POST /api/v1/records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        stalled.append(s)
    try:
        # Once the server has taken the stalled heads (on a busy machine that takes a moment), a
        # request beyond the pool is refused.
        deadline = time.monotonic() + 20
        while True:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(b"GET /api/v1/catalog HTTP/1.1\r\nHost: x\r\n\r\n")
                if read_all(s).startswith(b"HTTP/1.1 503"):
                    break
            assert time.monotonic() < deadline, "no request was refused with the pool full"
            time.sleep(0.1)
        for path in ("/healthz", "/metrics"):  # scrapes have threads of their own
            assert requests.get(exporter.url + path, timeout=5).status_code == 200
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the threads come back as the stalled bodies end
        try:
            if requests.get(exporter.url + "/api/v1/catalog", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_an_announced_large_body_is_refused_before_it_is_read(make: Callable[[str], Runtime]) -> None:
    exporter = make("records: {http: {max_body_bytes: 1000}}\nweb: {read_timeout: 30s}\n")
    host, port = exporter.server.address
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /api/v1/records HTTP/1.1\r\nHost: x\r\nContent-Length: 8000000\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 413")  # at once: not after 30 s of waiting for the body


def run_export(*args: str) -> subprocess.CompletedProcess[str]:
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([sys.executable, "-m", "prefixscope", "export", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)


def test_intake_beyond_loopback_needs_a_bearer_token(tmp_path: Path) -> None:
    out = run_export("--web.listen-address", "0.0.0.0:0")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bearer_token" in lines[0] and "0.0.0.0:0" in lines[0]
    cfg = tmp_path / "exporter.yaml"
    cfg.write_text("records: {http: {enabled: false}}\n")  # OTLP over HTTP is still a writer
    out = run_export("--config.file", str(cfg), "--web.listen-address", "0.0.0.0:0")
    assert out.returncode == 2 and "POST /v1/traces" in out.stderr and "bearer_token" in out.stderr
    cfg.write_text("records: {http: {enabled: false}}\notlp: {enabled: false, grpc_listen_address: 0.0.0.0:0}\n"
                   "web: {reload: false}\n")
    out = run_export("--config.file", str(cfg), "--web.listen-address", "0.0.0.0:0")
    assert out.returncode == 2 and "grpc_listen_address" in out.stderr and "bearer_token" in out.stderr
    cfg.write_text("records: {http: {enabled: false}}\notlp: {enabled: false}\n")
    out = run_export("--config.file", str(cfg), "--web.listen-address", "0.0.0.0:0")  # POST /-/reload is a writer
    assert out.returncode == 2 and "POST /-/reload (web.reload)" in out.stderr and "bearer_token" in out.stderr
    assert "/v1/traces" not in out.stderr and "/api/v1/records" not in out.stderr
    cfg.write_text("records: {http: {enabled: false}}\notlp: {enabled: false}\nweb: {reload: false}\n")
    rt = Runtime.build(load_config(cfg).with_overrides(listen_address="0.0.0.0:0"))  # no writer: no token needed
    rt.server.httpd.server_close()
    cfg.write_text("records: {http: {enabled: false, bearer_token: t}}\notlp: {enabled: false}\n")
    rt = Runtime.build(load_config(cfg).with_overrides(listen_address="0.0.0.0:0"))  # the reload with its token
    rt.server.httpd.server_close()


def test_the_reload_endpoint_can_be_turned_off(make: Callable[[str], Runtime]) -> None:
    on, off = make(""), make("web: {reload: false}\n")
    assert requests.post(on.url + "/-/reload", timeout=10).status_code == 200  # from this machine
    assert requests.post(off.url + "/-/reload", timeout=10).status_code == 404
    assert off.reload()[0]  # SIGHUP's path still reloads


# ---- /healthz ---------------------------------------------------------------------------------------------
HEALTHY_PAGE = (Path(__file__).resolve().parents[2] / "fixtures" / "vllm_0_33_dp2.txt").read_bytes()


def page_server(drip_s: float, served: list[float]) -> tuple[socket.socket, int]:
    """Serves a real vLLM page on ``/healthy``; on ``/drip`` it sends its status line and headers
    one byte every ``drip_s`` seconds — each read is quick, so only a whole-scrape deadline ends it."""
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def serve(c: socket.socket) -> None:
        try:
            request = c.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(HEALTHY_PAGE)
            if b"GET /drip" in request:
                for b in head:
                    c.send(bytes([b]))
                    time.sleep(drip_s)
            else:
                c.sendall(head + HEALTHY_PAGE)
                served.append(time.monotonic())
        except OSError:
            pass
        finally:
            c.close()

    def loop() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv, srv.getsockname()[1]


def _up(rt: Runtime) -> dict[str, float]:
    text = requests.get(rt.url + "/metrics", timeout=10).text
    return {m["target"]: float(m["v"]) for m in re.finditer(r'^prefixscope_up\{[^}]*target="(?P<target>[^"]+)"[^}]*\} (?P<v>\S+)$',
                                                             text, re.M)}


def test_healthz_reflects_the_exporter_not_its_slowest_target(tmp_path: Path) -> None:
    """A worker that drips its headers one byte every 0.5 s used to hold the scrape loop: the
    healthy worker went unscraped and /healthz answered 503 while `prefixscope_up` stayed 1."""
    served: list[float] = []
    srv, port = page_server(drip_s=0.5, served=served)
    rt = start(tmp_path, "scrape_interval: 1s\nscrape_timeout: 1s\nworkers:\n"
                         f"  - {{name: slow, metrics_url: 'http://127.0.0.1:{port}/drip'}}\n"
                         f"  - {{name: fine, metrics_url: 'http://127.0.0.1:{port}/healthy'}}\n")
    try:
        # one drip lasts 40 s; over several scrape intervals the exporter stays healthy
        statuses = []
        for _ in range(12):
            statuses.append(requests.get(rt.url + "/healthz", timeout=10).status_code)
            time.sleep(0.5)
        assert set(statuses) == {200}, statuses
        # the healthy worker was scraped round after round while the other dripped
        assert len(served) >= 3, served
        assert rt.scraper.last["slow"].error.startswith("timeout"), rt.scraper.last["slow"].error
        up = _up(rt)
        assert up["fine"] == 1.0 and up["slow"] == 0.0, up
    finally:
        rt.stop()
        srv.close()


def test_a_label_budget_frees_exactly_what_a_walk_from_its_oldest_value_would() -> None:
    """``expire`` skips its walk until the first value can be due; over random admissions the
    freed values and the folds are those of the walk done every time."""
    import random

    from exporter.core.cardinality import LabelBudget

    rng = random.Random(3)
    quick, walk = LabelBudget("model", 5, 10.0), LabelBudget("model", 5, 10.0)
    walk_expire = walk.expire

    def always_walk(now: float) -> list[str]:
        walk._due = -float("inf")
        return walk_expire(now)

    walk.expire = always_walk  # type: ignore[method-assign]
    now = 0.0
    for _ in range(5000):
        now += rng.choice((0.0, 0.5, 2.0, 7.0))
        assert quick.expire(now) == walk.expire(now)
        value, ts = f"m{rng.randrange(9)}", now - rng.choice((0.0, 0.0, 3.0, 12.0))
        assert quick.admit(value, ts) == walk.admit(value, ts)
    assert quick.folded == walk.folded and list(quick._last.items()) == list(walk._last.items())
