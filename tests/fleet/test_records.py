"""Request records: schema validity of what the router emits, and both ways out (file, HTTP)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fleet.records import FileSink, HttpSink, schema_errors, to_ndjson
from fleet.scenarios import load_preset
from fleet.simulation import Simulation
from fleet.topology import load_topology

SCHEMA_FIELDS = ("ts", "request_id", "session_key", "worker", "model", "prompt_tokens", "block_hashes",
                 "block_size", "cached_tokens", "predicted_cached_tokens", "ttft_s", "prefill_s", "queue_s",
                 "walk_s", "decision", "fallback_tier", "async_wait_s", "migrated_from", "migration_kind",
                 "migrate_s", "expert_signature", "admitted_by_affinity", "segment")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """Records of a run that exercises migrations (soft and hard), fallbacks and the async lane."""
    sim = Simulation(load_preset("cross-node-migration-storm"), load_topology(), duration_s=420)
    out = sim.run().records
    sim = Simulation(load_preset("worker-failures"), load_topology(), duration_s=330)
    return out + sim.run().records


def test_every_record_validates_against_the_published_schema(records: list[dict]) -> None:
    assert len(records) > 1000
    # Item-wise validation of thousands of 300-hash arrays is slow in jsonschema: the schema
    # sees each record with its first hashes, and the rest of each array is checked in bulk.
    bad = [(r["request_id"], errs) for r in records
           if (errs := schema_errors(r | {"block_hashes": r["block_hashes"][:4]}))]
    assert bad == []
    for r in records:
        h = r["block_hashes"]
        assert {type(x) for x in h} == {int} and min(h) >= 0 and max(h) < 2**64
    assert all(set(SCHEMA_FIELDS) <= r.keys() for r in records)


def test_records_carry_each_optional_signal_somewhere(records: list[dict]) -> None:
    kinds = {r["migration_kind"] for r in records}
    tiers = {r["fallback_tier"] for r in records}
    assert {"soft", "hard"} <= kinds
    assert {"warm_pool", "async_prefill"} <= tiers
    soft = next(r for r in records if r["migration_kind"] == "soft")
    assert soft["migrate_s"] > 0 and soft["migrated_from"] != soft["worker"]
    assert all(r["cached_tokens"] <= r["prompt_tokens"] for r in records)
    assert all(r["predicted_cached_tokens"] % 16 == 0 for r in records)


def test_schema_errors_are_readable() -> None:
    errs = schema_errors({"ts": -1, "request_id": "", "worker": "w0", "prompt_tokens": 5, "migration_kind": "warm"})
    assert any(e.startswith("ts: ") for e in errs)
    assert any(e.startswith("request_id: ") for e in errs)
    assert any(e.startswith("migration_kind: ") for e in errs)
    assert schema_errors({"ts": 1.0, "request_id": "r", "worker": "w0", "prompt_tokens": 5}) == []


def test_file_sink_appends_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "records.ndjson"
    path.write_text('{"old": true}\n')
    sink = FileSink(path, flush_every=2)
    for i in range(5):
        sink.emit({"request_id": f"r{i}", "ts": i})
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x).get("request_id") for x in lines] == [None, "r0", "r1", "r2", "r3", "r4"]


class RecordReceiver:
    """A real HTTP server taking NDJSON POSTs; it answers 503 to its first ``fail_first``."""

    def __init__(self, fail_first: int = 0, status: int = 200) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                code = 503 if outer.calls <= fail_first else status
                if code == 200:
                    outer.bodies.append(body)
                    outer.headers.append(dict(self.headers))
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/records"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def lines(self) -> list[bytes]:
        return [line for body in self.bodies for line in body.splitlines()]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_http_sink_batches_ndjson_and_retries_with_backoff() -> None:
    rx = RecordReceiver(fail_first=2)
    try:
        sink = HttpSink(rx.url, batch_size=4, flush_interval_s=0.05, backoff_s=0.01, token="s3cret")
        for i in range(10):
            sink.emit({"request_id": f"r{i}", "ts": float(i), "worker": "w0", "prompt_tokens": 1})
        sink.close()
    finally:
        rx.close()
    got = [json.loads(line)["request_id"] for body in rx.bodies for line in body.splitlines()]
    assert got == [f"r{i}" for i in range(10)]  # nothing lost, in order, despite two 503s
    assert all(len(b.splitlines()) <= 4 for b in rx.bodies)
    assert rx.headers[0]["Authorization"] == "Bearer s3cret"
    assert rx.headers[0]["Content-Type"] == "application/x-ndjson"
    assert sink.sent == 10 and sink.dropped == 0 and sink.failed_posts == 2


def test_http_sink_never_blocks_routing_and_bounds_its_buffer() -> None:
    # nothing listens on this port: every POST fails; emit must still return at once
    sink = HttpSink("http://127.0.0.1:9/unreachable", max_buffer=100, batch_size=1000,
                    flush_interval_s=60, backoff_s=0.01, max_retries=0, timeout_s=0.2)
    t0 = time.perf_counter()
    for i in range(1000):
        sink.emit({"request_id": f"r{i}"})
    assert time.perf_counter() - t0 < 0.5
    assert sink.dropped >= 900  # the oldest records went first, the buffer stayed at 100
    sink.close(timeout_s=5)


def test_a_rejected_batch_is_counted_not_retried() -> None:
    rx = RecordReceiver(status=400)
    try:
        sink = HttpSink(rx.url, batch_size=2, flush_interval_s=0.05, backoff_s=0.01)
        sink.emit({"request_id": "r1"})
        sink.emit({"request_id": "r2"})
        sink.close()
    finally:
        rx.close()
    assert rx.calls == 1 and sink.dropped == 2 and sink.sent == 0


def test_ndjson_is_one_compact_object_per_line() -> None:
    assert to_ndjson([{"a": 1}, {"b": [1, 2]}]) == b'{"a":1}\n{"b":[1,2]}\n'
