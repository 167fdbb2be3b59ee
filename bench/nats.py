"""The scale-out path on this machine: relay → NATS JetStream → NATS source → index, and a shard.

Rows (block events: stored plus removed blocks, as ``bench.ingest`` counts them; the payloads are
``bench.ingest``'s busy vLLM workers, one set per worker):

* **NATS path end to end**: ``Relay.forward`` of every worker's batches → a local ``nats-server``
  (file storage) → one exporter's ``NatsKvSource`` applying them to a ``ClusterState``, pipelined,
  until the last batch is applied; baseline: the same payloads decoded and applied in process
  (the ZMQ subscriber's work), same run;
* **relay publish** alone (each worker's batches in order, one acknowledged publish in flight per
  worker) and the **NATS source rebuild** alone (fetch from the retained stream, decode, apply);
* **a shard's ingest**: shard 0 of 4 routing every batch of the cluster stream through its family
  table and applying its quarter, against one exporter applying everything, same payloads;
* **memory of a shard's family table**, bytes per resident block of the cluster (tracemalloc).

Stream bytes per event come with the end-to-end row. Without ``nats-server`` the NATS rows say so
and pass (the shard rows still run). ``python -m bench nats``.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import nats

from bench.ingest import payloads
from exporter.bootstrap import bootstrap, build_nats_source, family_sink
from exporter.codecs import kvcodec
from exporter.codecs.kv_stream import DEFAULT_STREAM
from exporter.config import Config, NatsKv, Shard, WorkerTarget
from exporter.core.health import Health
from exporter.core.sharding import FamilyRouter, ShardSpec
from exporter.model import BlockStored, KvBatch
from exporter.relay import Relay, RelayConfig

WORKERS = 8
BATCHES_PER_WORKER = 400
SHARDS = 4


def _workload() -> tuple[list[tuple[str, int, bytes]], int]:
    """Every worker's batches, interleaved round-robin as a stream would carry them, and the block events."""
    per: list[list[bytes]] = []
    events = 0
    for w in range(WORKERS):
        data, blocks = payloads(BATCHES_PER_WORKER, seed=w + 1)
        per.append(data)
        events += blocks
    order = [(f"w{w}", seq, per[w][seq]) for seq in range(BATCHES_PER_WORKER) for w in range(WORKERS)]
    return order, events


def _in_process(order: list[tuple[str, int, bytes]]) -> float:
    state = bootstrap().state
    health = state.health
    t0 = time.perf_counter()
    for worker, seq, p in order:
        batch = kvcodec.decode_batch(p, worker, seq, health)
        state.apply_kv_batch(batch, batch.ts)
    return time.perf_counter() - t0


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class _Server:
    def __init__(self, binary: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.store = tempfile.mkdtemp(prefix="bench-nats-")
        self.proc = subprocess.Popen([binary, "-js", "-sd", self.store, "-p", str(self.port), "-a", "127.0.0.1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"nats://127.0.0.1:{self.port}"

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        _wait(up, 20)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.store, ignore_errors=True)

    def stream_bytes(self) -> int:
        async def get() -> int:
            nc = await nats.connect(self.url)
            info = await nc.jetstream().stream_info(DEFAULT_STREAM)
            await nc.close()
            return int(info.state.bytes)
        return asyncio.run(get())


def _source(url: str, durable: str) -> Any:
    cfg = Config(kv_nats=NatsKv(url=url, all_workers=True, durable=durable))
    state = bootstrap(cfg).state
    src = build_nats_source(cfg, (), state, state.health)
    assert src is not None
    return src


def _nats_rows(binary: str, order: list[tuple[str, int, bytes]], events: int, baseline_s: float
               ) -> Iterator[dict[str, Any]]:
    server = _Server(binary)
    try:
        workers = tuple(WorkerTarget(f"w{w}", kv_events=f"tcp://127.0.0.1:{1 + w}") for w in range(WORKERS))
        relay = Relay(RelayConfig(nats_url=server.url, max_bytes=4 << 30, workers=workers))
        relay.start()
        live = _source(server.url, "bench-live")
        live.start()
        assert live.wait_started(60)
        n = len(order)
        t0 = time.perf_counter()
        for worker, seq, p in order:
            relay.forward(worker, seq, p)
        relay_done = _wait(lambda: relay.published >= n, 600)
        relay_s = time.perf_counter() - t0
        applied = _wait(lambda: live.applied >= n, 600)
        e2e_s = time.perf_counter() - t0
        live.close()
        relay.close()
        nbytes = server.stream_bytes()

        rebuild = _source(server.url, "bench-rebuild")
        t0 = time.perf_counter()
        rebuild.start()
        rebuilt = rebuild.wait_started(600) and rebuild.applied >= n
        rebuild_s = time.perf_counter() - t0
        rebuild.close()
    finally:
        server.close()
    base = events / baseline_s
    yield {"name": f"NATS path: relay → JetStream → source → index, block events/s ({WORKERS} workers; "
                   f"{nbytes / events:.0f} B/event in the stream)",
           "value": events / e2e_s if applied else None, "baseline": base, "ratio": e2e_s / baseline_s,
           "target": "all applied; baseline: in-process decode + apply", "ok": applied}
    yield {"name": "relay publish to JetStream (acknowledged), block events/s", "value": events / relay_s,
           "baseline": base, "ratio": relay_s / baseline_s, "target": "-", "ok": relay_done}
    yield {"name": "NATS source rebuild from the stream (fetch + decode + apply), block events/s",
           "value": events / rebuild_s if rebuilt else None, "baseline": base, "ratio": rebuild_s / baseline_s,
           "target": "-", "ok": rebuilt}


def _shard_rows(order: list[tuple[str, int, bytes]], events: int, baseline_s: float) -> Iterator[dict[str, Any]]:
    health = Health()
    batches = [kvcodec.decode_batch(p, w, seq, health) for w, seq, p in order]

    def apply_all(sink: Any) -> float:
        t0 = time.perf_counter()
        for b in batches:
            sink.apply_kv_batch(b, b.ts)
        return time.perf_counter() - t0

    single_s = min(apply_all(bootstrap().state) for _ in range(3))
    shard_s = float("inf")
    for _ in range(3):
        parts = bootstrap(Config(shard=Shard(0, SHARDS), kv_nats=NatsKv(url="nats://127.0.0.1:4222")))
        shard_s = min(shard_s, apply_all(family_sink(parts.state, ShardSpec(0, SHARDS), parts.health)))
    yield {"name": f"shard 0 of {SHARDS}: route the whole stream + apply its families, cluster block events/s",
           "value": events / shard_s, "baseline": events / single_s, "ratio": shard_s / single_s,
           "target": "- (baseline: one exporter applying everything)", "ok": True}

    blocks = 200_000
    run = 64
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    router = FamilyRouter(ShardSpec(0, SHARDS))
    for i in range(blocks // run):
        base = i * run + 1
        router.route(KvBatch(f"w{i % WORKERS}", i, 0.0, (BlockStored(tuple(range(base, base + run)), None, 16),)))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    yield {"name": "a shard's family table, bytes per resident block of the cluster", "value": used / blocks,
           "baseline": None, "ratio": None, "target": "-", "ok": len(router) == blocks}


def run() -> Iterator[dict[str, Any]]:
    order, events = _workload()
    baseline_s = min(_in_process(order) for _ in range(3))
    binary = shutil.which("nats-server")
    if binary is None:
        yield {"name": "NATS path (nats-server not installed: not measured)", "value": None, "ok": True}
    else:
        yield from _nats_rows(binary, order, events, baseline_s)
    yield from _shard_rows(order, events, baseline_s)


if __name__ == "__main__":
    for row in run():
        print(row)
