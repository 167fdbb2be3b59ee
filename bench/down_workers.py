"""KV batches and records while workers are marked down: no walk over the workers per input.

When the exporter's own scrapes of its workers time out, the workers are marked down (their up
gauge at 0) while their KV events and records keep coming. That must not make each input cost
work that grows with the fleet: which targets are down, since when, and which down workers left
the pool are kept as the up gauges change, and each input judges only its own worker.

Two states of 1,000 workers, alike but for their up gauges (all up; 30 % down), take the same KV
batches (one 64-block store per worker, round after round) and the same one-record bodies, turn
about, in this thread's CPU time. Rows: the down state's time against the all-up state's (the
median of the rounds' ratios), for batches and for records; target ≤ 1.3× (noise included). While
each input from a down worker walked the workers, the same inputs took about five times as long.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

from bench._cluster_fleet import Shape, worker_name
from bench._cluster_records import RecordMaker
from exporter.bootstrap import bootstrap
from exporter.model import BlockStored, KvBatch, WorkerSnapshot
from exporter.sources.records import parse_ndjson

WORKERS = 1000
DOWN = 0.3
ROUNDS = 5
TARGET = 1.3


def _state(down: float, now: float) -> Any:
    st = bootstrap().state
    names = [worker_name(i) for i in range(WORKERS)]
    for n in names:
        st.health.set("prefixscope_up", (n, "worker"), 1.0)
        st.observe_worker(WorkerSnapshot(n, "vllm", model="m", num_gpu_blocks=10_000, running=3), now)
    for n in random.Random(1).sample(names, int(WORKERS * down)):
        st.health.set("prefixscope_up", (n, "worker"), 0.0)
        st.observe_worker(WorkerSnapshot(n, "vllm", model="m", num_gpu_blocks=10_000, running=3), now + 0.5)
    return st


def run() -> Iterator[dict[str, Any]]:
    now = time.time()
    states = {"up": _state(0.0, now), "down": _state(DOWN, now)}
    maker = RecordMaker(WORKERS, Shape(), seed=2)
    kv: dict[str, list[float]] = {k: [] for k in states}
    rec: dict[str, list[float]] = {k: [] for k in states}
    t = now + 1.0
    for r in range(ROUNDS):
        batches = [KvBatch(worker_name(i), r + 10, t, (BlockStored(tuple(range((r * WORKERS + i) << 7,
                                                                                ((r * WORKERS + i) << 7) + 64)),
                                                                   None, 16),)) for i in range(WORKERS)]
        bodies = [parse_ndjson(maker.body(1), 1 << 30)[0] for _ in range(WORKERS)]
        t += 1.0
        for key, st in states.items():
            c0 = time.thread_time()
            for b in batches:
                st.apply_kv_batch(b, t)
            kv[key].append(time.thread_time() - c0)
            c0 = time.thread_time()
            for records in bodies:
                st.ingest_records(records, t)
            rec[key].append(time.thread_time() - c0)
    for what, times, unit in (("KV batches (one 64-block store each)", kv, "batch"),
                              ("one-record bodies", rec, "record")):
        ratio = statistics.median(d / u for d, u in zip(times["down"], times["up"], strict=True))
        per = statistics.median(times["down"]) / WORKERS * 1e6
        yield {"name": f"{what} with {DOWN:.0%} of {WORKERS:,} workers marked down, µs of CPU a {unit} "
                       "(baseline: all up; ratio: the rounds' median)",
               "value": per, "baseline": statistics.median(times["up"]) / WORKERS * 1e6, "ratio": ratio,
               "target": f"≤ {TARGET:g}× all up", "ok": ratio <= TARGET}


if __name__ == "__main__":
    for row in run():
        print(row)
