"""Throughput of the NATS path on this machine: relay → JetStream → NATS source → ClusterState.

Not part of ``python -m bench`` (it needs ``nats-server``): run ``python -m bench._nats_path``.
Prints events/s published by the relay (one in-flight publish per worker, acknowledged),
events/s applied by one exporter's NATS source, bytes per event in the stream, and the memory
of the family table and a shard's index for a given number of resident blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import shutil
import subprocess
import tempfile
import time

import msgpack
import nats

from exporter.bootstrap import bootstrap, build_nats_source
from exporter.config import Config, NatsKv, Shard, WorkerTarget
from exporter.model import BlockStored, KvBatch
from exporter.relay import Relay, RelayConfig
from exporter.sharding import ShardSink, ShardSpec

EVENTS_PER_BATCH = 8  # stored runs and removals per scheduler step under load


def payload(i: int) -> bytes:
    evs = []
    for k in range(EVENTS_PER_BATCH):
        h = (i * EVENTS_PER_BATCH + k) * 4 + 1
        if k % 2:
            evs.append({"type": "BlockRemoved", "block_hashes": [h - 4], "medium": "GPU"})
        else:
            evs.append({"type": "BlockStored", "block_hashes": [h, h + 1, h + 2], "parent_block_hash": None,
                        "token_ids": list(range(48)), "block_size": 16, "lora_id": None, "medium": "GPU",
                        "lora_name": None})
    return msgpack.packb([time.time(), evs, 0])


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    a = ap.parse_args()
    binary = shutil.which("nats-server")
    assert binary, "apt-get install nats-server"
    store = tempfile.mkdtemp()
    port = 14222
    proc = subprocess.Popen([binary, "-js", "-sd", store, "-p", str(port), "-a", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    url = f"nats://127.0.0.1:{port}"
    try:
        workers = tuple(WorkerTarget(f"w{i}", kv_events=f"tcp://127.0.0.1:{20000 + i}") for i in range(a.workers))
        relay = Relay(RelayConfig(nats_url=url, max_bytes=8 << 30, workers=workers)).start()
        payloads = [payload(i) for i in range(a.batches)]
        t0 = time.perf_counter()
        for i, p in enumerate(payloads):
            relay.forward(f"w{i % a.workers}", i // a.workers, p)
        while relay.published < a.batches:
            time.sleep(0.01)
        relay_s = time.perf_counter() - t0
        relay.close()

        async def stream_bytes() -> int:
            nc = await nats.connect(url)
            info = await nc.jetstream().stream_info("PREFIXSCOPE_KV")
            await nc.close()
            return info.state.bytes
        nbytes = asyncio.run(stream_bytes())

        cfg = Config(kv_nats=NatsKv(url=url, all_workers=True))
        parts = bootstrap(cfg)
        src = build_nats_source(cfg, (), parts.state, parts.health)
        t0 = time.perf_counter()
        src.start()
        src.wait_started(600)
        source_s = time.perf_counter() - t0
        src.close()
        events = a.batches * EVENTS_PER_BATCH
        print(f"relay publish: {a.batches / relay_s:,.0f} batches/s = {events / relay_s:,.0f} events/s "
              f"({a.workers} workers, {EVENTS_PER_BATCH} events/batch)")
        print(f"NATS source rebuild (fetch + decode + apply): {a.batches / source_s:,.0f} batches/s = "
              f"{events / source_s:,.0f} events/s")
        print(f"stream: {nbytes / a.batches:,.0f} bytes/batch = {nbytes / events:,.0f} bytes/event")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(store, ignore_errors=True)

    # Memory: one shard of 4 holding its quarter of the index, plus the whole family table.
    gc.collect()
    before = rss_mb()
    parts = bootstrap(Config(shard=Shard(0, 4)))
    sink = ShardSink(parts.state, ShardSpec(0, 4))
    run = 64
    for i in range(a.blocks // run):
        base = i * run + 1
        sink.apply_kv_batch(KvBatch(f"w{i % a.workers}", i, 0.0,
                                    (BlockStored(tuple(range(base, base + run)), None, 16),)), 0.0)
    after = rss_mb()
    print(f"shard 0 of 4 with {a.blocks:,} resident blocks in the cluster: family table {len(sink.router):,} blocks, "
          f"own index {len(parts.state.index):,} blocks, RSS +{after - before:,.0f} MB "
          f"({(after - before) * 2**20 / a.blocks:,.0f} B per cluster block)")


if __name__ == "__main__":
    main()
