"""Request-record intake: ``POST /api/v1/records`` end to end, and the state work per record.

A real exporter (``exporter.main.Runtime``: its HTTP server, routes, intake and background
threads) on 127.0.0.1, with a prefix index filled the way ``bench._cluster_fleet``'s workers
fill it (a system prompt per family, then resident chains). A client posts NDJSON bodies of
``BATCH`` realistic records (``bench._cluster_records.RecordMaker``: session keys, block hashes
of resident and evicted chains, cached tokens, prefill and queue times) over one kept-alive
connection. The same lines are decoded with bare ``json.loads`` in the same run: that is the
baseline (the least any intake must do with them).

Rows: records/s over HTTP (target ≥ 20 k/s), the state's work per record
(``ClusterState.ingest_records`` on already-parsed records) and the parse/validate work per
record, and the bytes the state holds per record after a minute of records (target ≤ 1 KB).
"""

from __future__ import annotations

import gc
import json
import socket
import statistics
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

from bench._cluster_fleet import BLOCK_SIZE, Shape, chain_hashes, family_of, prefix_hashes, worker_name
from bench._cluster_records import RecordMaker
from exporter.config import Config
from exporter.main import Runtime
from exporter.model import BlockStored, KvBatch
from exporter.sources.records import parse_ndjson

TARGET_RATE = 20_000.0  # records/s through POST /api/v1/records
TARGET_BYTES = 1024.0  # held per record in the windows
WORKERS = 64
BATCH = 2000  # records per POST body
BODIES = 10  # bodies per timed run
REPEATS = 3
SHAPE = Shape()


def fill_index(runtime: Runtime, workers: int, shape: Shape) -> None:
    """Every worker's warm cache: its family's system prompt, then its first M chains."""
    now = time.time()
    for w in range(workers):
        prefix = tuple(prefix_hashes(family_of(w, shape), shape))
        events = [BlockStored(prefix, None, BLOCK_SIZE, len(prefix) * BLOCK_SIZE)]
        events += [BlockStored(tuple(chain_hashes(w, c, shape)), prefix[-1], BLOCK_SIZE,
                               shape.blocks_per_event * BLOCK_SIZE) for c in range(shape.resident_chains)]
        runtime.state.apply_kv_batch(KvBatch(worker_name(w), 0, now, tuple(events)), now)


class Client:
    """One kept-alive HTTP/1.1 connection posting prepared bodies (no client library in the way)."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    @staticmethod
    def request(body: bytes) -> bytes:
        return (b"POST /api/v1/records HTTP/1.1\r\nHost: bench\r\nContent-Type: application/x-ndjson\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)) + body

    def post(self, request: bytes) -> dict[str, Any]:
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(self.buf) < length:
            self._more()
        answer, self.buf = self.buf[:length], self.buf[length:]
        if status != 200:
            raise RuntimeError(f"POST answered {status}: {answer[:300]!r}")
        return json.loads(answer)

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise RuntimeError("the exporter closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def _bodies(maker: RecordMaker, n: int) -> list[bytes]:
    return [maker.body(BATCH) for _ in range(n)]


def _decode_rate(bodies: list[bytes]) -> float:
    """Records/s of bare ``json.loads`` over the lines of ``bodies``."""
    lines = [line for b in bodies for line in b.split(b"\n")]
    loads = json.loads
    t0 = time.perf_counter()
    for line in lines:
        loads(line)
    return len(lines) / (time.perf_counter() - t0)


def _http_rate(client: Client, bodies: list[bytes]) -> float:
    requests = [Client.request(b) for b in bodies]
    t0 = time.perf_counter()
    accepted = 0
    for r in requests:
        accepted += client.post(r)["data"]["accepted"]
    elapsed = time.perf_counter() - t0
    if accepted != BATCH * len(bodies):
        raise RuntimeError(f"{accepted} of {BATCH * len(bodies)} records accepted")
    return accepted / elapsed


def _split_costs(runtime: Runtime, bodies: list[bytes]) -> tuple[float, float]:
    """Seconds per record of parsing+validating, and of the state's work on the parsed records."""
    parse_s = state_s = 0.0
    n = 0
    state = runtime.state
    for body in bodies:
        now = time.time()
        t0 = time.perf_counter()
        records, errors = parse_ndjson(body, 1 << 30, now=now)
        t1 = time.perf_counter()
        state.ingest_records(records, now)
        t2 = time.perf_counter()
        assert not errors, errors[:3]
        parse_s += t1 - t0
        state_s += t2 - t1
        n += len(records)
    return parse_s / n, state_s / n


def _bytes_per_record(minutes: float = 1.0, per_second: int = 500) -> float:
    """Bytes the state holds per record after ``minutes`` of records at ``per_second`` (traced)."""
    rt = Runtime.build(Config(listen_address="127.0.0.1:0"))
    fill_index(rt, WORKERS, SHAPE)
    maker = RecordMaker(WORKERS, SHAPE, seed=7)
    start = time.time() - 60.0 * minutes
    seconds = int(60 * minutes)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in range(seconds):
        ts = start + s
        lines = "\n".join(maker.line(ts + i / per_second) for i in range(per_second)).encode()
        records, _ = parse_ndjson(lines, 1 << 30)
        rt.state.ingest_records(records, ts + 1.0)
        del records, lines
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / (seconds * per_second)


def run() -> Iterator[dict[str, Any]]:
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0")).start()
    try:
        fill_index(runtime, WORKERS, SHAPE)
        maker = RecordMaker(WORKERS, SHAPE, seed=1)
        host, port = runtime.server.address
        client = Client(host, port)
        client.post(Client.request(maker.body(BATCH)))  # warm: sessions and labels exist
        http, decode, parse, work = [], [], [], []
        for _ in range(REPEATS):
            bodies = _bodies(maker, BODIES)
            decode.append(_decode_rate(bodies))
            http.append(_http_rate(client, bodies))
            p, w = _split_costs(runtime, _bodies(maker, 3))
            parse.append(p)
            work.append(w)
        client.close()
    finally:
        runtime.stop()
    rate, base = statistics.median(http), statistics.median(decode)
    per_decode = 1.0 / base
    parse_s, work_s = statistics.median(parse), statistics.median(work)
    yield {"name": f"records over HTTP, keep-alive, {BATCH}/body, records/s", "value": rate, "baseline": base,
           "ratio": rate / base, "target": f"≥ {TARGET_RATE:,.0f}/s", "ok": rate >= TARGET_RATE}
    yield {"name": "state work per record (ingest_records), µs", "value": work_s * 1e6,
           "baseline": per_decode * 1e6, "ratio": work_s / per_decode, "target": "information", "ok": True}
    yield {"name": "parse + validate per record, µs", "value": parse_s * 1e6,
           "baseline": per_decode * 1e6, "ratio": parse_s / per_decode, "target": "information", "ok": True}
    held = _bytes_per_record()
    yield {"name": "state bytes held per record (1 min at 500/s)", "value": held, "baseline": None,
           "ratio": None, "target": f"≤ {TARGET_BYTES:g} B", "ok": held <= TARGET_BYTES}


if __name__ == "__main__":
    for row in run():
        print(row)
