"""Request-record intake: ``POST /api/v1/records`` end to end, and the state work per record.

A real exporter (``exporter.main.Runtime``: its HTTP server, routes, intake and background
threads) on 127.0.0.1, with a prefix index filled the way ``bench._cluster_fleet``'s workers
fill it (a system prompt per family, then resident chains). A client posts NDJSON bodies of
``BATCH`` realistic records (``bench._cluster_records.RecordMaker``: session keys, block hashes
of resident and evicted chains, cached tokens, prefill and queue times) over one kept-alive
connection. The same lines are decoded with bare ``json.loads`` in the same run: that is the
baseline (the least any intake must do with them).

Rows: records/s per core through HTTP — the records posted over the exporter's CPU seconds
(every thread of its process) while they were posted: what one core of the exporter sustains,
target ≥ 50 k/s — and, for information, the wall-clock rate (on a shared machine it follows the
load as much as the code), the exporter's CPU per record, the state's work per record
(``ClusterState.ingest_records`` on parsed records) and the parse/validate work per record (CPU
time of the calling thread), and the bytes the windows hold per record after a minute of
records (target ≤ 1 KB; the whole state's bytes per record, sessions and hit history included,
beside it). Baselines: bare ``json.loads`` of the same lines, records/s or µs per record. Two
more rows set each compiled step against its Python reference on the same records in the same
run: the state's work (``exporter.core.record_slice``: compiled core or reference) and the
parse (the typed msgspec decoder, or the fast path and careful steps without it).
"""

from __future__ import annotations

import gc
import json
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import exporter.core.state as state_module
from bench._cluster_fleet import BLOCK_SIZE, Shape, chain_hashes, family_of, prefix_hashes, worker_name
from bench._cluster_records import RecordMaker
from exporter.config import Config
from exporter.core import record_slice
from exporter.main import Runtime
from exporter.model import BlockStored, KvBatch
from exporter.sources import records as records_source
from exporter.sources.records import parse_ndjson

TARGET_RATE = 50_000.0  # records/s per core of exporter CPU through POST /api/v1/records
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
    """Records per CPU second of bare ``json.loads`` over the lines of ``bodies``."""
    lines = [line for b in bodies for line in b.split(b"\n")]
    loads = json.loads
    t0 = time.thread_time()
    for line in lines:
        loads(line)
    return len(lines) / (time.thread_time() - t0)


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


def client_main(host: str, port: int, seed: int) -> None:
    """The client process: per ``go`` line on stdin, one run of ``BODIES`` bodies; answers JSON lines.

    Before each run it builds the bodies and decodes their lines (the baseline), says ``ready``
    and waits, so the exporter's CPU time can be read around the posting alone."""
    maker = RecordMaker(WORKERS, SHAPE, seed=seed)
    client = Client(host, port)
    client.post(Client.request(maker.body(BATCH)))  # warm: sessions and labels exist
    for line in sys.stdin:
        if line.strip() != "prepare":
            break
        bodies = _bodies(maker, BODIES)
        decode = _decode_rate(bodies)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # go
        rate = _http_rate(client, bodies)
        print(json.dumps({"rate": rate, "decode": decode, "records": BATCH * BODIES}), flush=True)
    client.close()


def _http_runs(runtime: Runtime) -> tuple[list[float], list[float], list[float]]:
    """Records/s over HTTP, bare-decode records/s and the exporter's CPU seconds per record, per run."""
    host, port = runtime.server.address
    proc = subprocess.Popen([sys.executable, "-m", "bench.records", "--client", host, str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    rates, decodes, cpu = [], [], []
    try:
        for _ in range(REPEATS):
            proc.stdin.write("prepare\n")
            proc.stdin.flush()
            json.loads(proc.stdout.readline())
            c0 = time.process_time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
            c1 = time.process_time()
            if not answer:
                raise RuntimeError("the client process ended early")
            got = json.loads(answer)
            rates.append(got["rate"])
            decodes.append(got["decode"])
            cpu.append((c1 - c0) / got["records"])
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rates, decodes, cpu


def _split_costs(runtime: Runtime, bodies: list[bytes], apply: Callable[..., None] | None = None,
                 typed: bool = True) -> tuple[float, float]:
    """CPU seconds per record of parsing+validating, and of the state's work on the parsed records;
    ``apply`` (the per-record work's implementation) and ``typed`` (the typed decoder) as given."""
    saved = state_module.apply_records, records_source.TYPED_RECORD
    state_module.apply_records = apply or saved[0]
    records_source.TYPED_RECORD = saved[1] if typed else None
    try:
        return _costs(runtime, bodies)
    finally:
        state_module.apply_records, records_source.TYPED_RECORD = saved


def _costs(runtime: Runtime, bodies: list[bytes]) -> tuple[float, float]:
    parse_s = state_s = 0.0
    n = 0
    state = runtime.state
    for body in bodies:
        now = time.time()
        t0 = time.thread_time()
        records, errors = parse_ndjson(body, 1 << 30, now=now)
        t1 = time.thread_time()
        state.ingest_records(records, now)
        t2 = time.thread_time()
        assert not errors, errors[:3]
        parse_s += t1 - t0
        state_s += t2 - t1
        n += len(records)
    return parse_s / n, state_s / n


WINDOW_FILES = ("*/exporter/core/windows.py", "*/exporter/core/metric_store.py", "*/exporter/core/baseline_window.py")


def _warm_runtime() -> Runtime:
    """A state (not started) with the bench's index and a first body of records in: sessions and labels exist."""
    rt = Runtime.build(Config(listen_address="127.0.0.1:0"))
    fill_index(rt, WORKERS, SHAPE)
    _costs(rt, _bodies(RecordMaker(WORKERS, SHAPE, seed=1), 1))
    return rt


def _bytes_per_record(seconds: int = 60, per_second: int = 1000) -> tuple[float, float]:
    """Bytes per record the windows hold, and the whole state holds, after ``seconds`` of records
    at ``per_second`` (allocations traced from the first record on, still alive at the end)."""
    rt = Runtime.build(Config(listen_address="127.0.0.1:0"))
    fill_index(rt, WORKERS, SHAPE)
    maker = RecordMaker(WORKERS, SHAPE, seed=7)
    start = time.time() - seconds
    gc.collect()
    tracemalloc.start()
    for s in range(seconds):
        ts = start + s
        lines = "\n".join(maker.line(ts + i / per_second) for i in range(per_second)).encode()
        records, _ = parse_ndjson(lines, 1 << 30)
        rt.state.ingest_records(records, ts + 1.0)
        del records, lines
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    whole = sum(t.size for t in snapshot.traces)
    windows = sum(t.size for t in snapshot.filter_traces(
        [tracemalloc.Filter(True, pattern) for pattern in WINDOW_FILES]).traces)
    n = seconds * per_second
    return windows / n, whole / n


def run() -> Iterator[dict[str, Any]]:
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0")).start()
    try:
        fill_index(runtime, WORKERS, SHAPE)
        http, decode, cpu = _http_runs(runtime)
    finally:
        runtime.stop()
    costs, reference = [], []
    for seed in range(REPEATS):  # the same records through each, alternating, on states alike
        bodies = _bodies(RecordMaker(WORKERS, SHAPE, seed=2 + seed), 3)
        costs.append(_split_costs(_warm_runtime(), bodies))
        reference.append(_split_costs(_warm_runtime(), bodies, record_slice.reference_apply_records, typed=False))
    rate, base = statistics.median(http), statistics.median(decode)
    per_decode = 1.0 / base
    cpu_s = statistics.median(cpu)
    parse_s = statistics.median(p for p, _ in costs)
    work_s = statistics.median(w for _, w in costs)
    per_core = 1.0 / cpu_s
    yield {"name": f"records/s per core over HTTP (exporter CPU), keep-alive, {BATCH}/body", "value": per_core,
           "baseline": base, "ratio": per_core / base, "target": f"≥ {TARGET_RATE:,.0f}/s",
           "ok": per_core >= TARGET_RATE}
    yield {"name": "records/s over HTTP, wall clock (the box is shared)", "value": rate, "baseline": base,
           "ratio": rate / base, "target": "information", "ok": True}
    yield {"name": "exporter CPU per record over HTTP, µs", "value": cpu_s * 1e6, "baseline": per_decode * 1e6,
           "ratio": cpu_s / per_decode, "target": "information", "ok": True}
    yield {"name": "state work per record (ingest_records), µs", "value": work_s * 1e6,
           "baseline": per_decode * 1e6, "ratio": work_s / per_decode, "target": "information", "ok": True}
    yield {"name": "parse + validate per record, µs", "value": parse_s * 1e6,
           "baseline": per_decode * 1e6, "ratio": parse_s / per_decode, "target": "information", "ok": True}
    ref_parse = statistics.median(p for p, _ in reference)
    ref_work = statistics.median(w for _, w in reference)
    yield {"name": f"state work per record, compiled core ({record_slice.CORE}) against its Python reference, µs",
           "value": work_s * 1e6, "baseline": ref_work * 1e6, "ratio": work_s / ref_work, "target": "information",
           "ok": True}
    yield {"name": "parse + validate per record, typed decoder against the fast path without it, µs",
           "value": parse_s * 1e6, "baseline": ref_parse * 1e6, "ratio": parse_s / ref_parse,
           "target": "information", "ok": True}
    windows, whole = _bytes_per_record()
    yield {"name": "window bytes held per record (1 min at 1,000/s)", "value": windows, "baseline": whole,
           "ratio": windows / whole if whole else None, "target": f"≤ {TARGET_BYTES:g} B", "ok": windows <= TARGET_BYTES}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client_main(sys.argv[2], int(sys.argv[3]), seed=1)
    else:
        for row in run():
            print(row)
