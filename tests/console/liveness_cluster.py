"""A real ClusterState with four scraped workers: two up, one down but still serving, one gone.

Hand-laid inputs (times in seconds; the state's clock stands at 1000):
  900  scrapes of w0..w3 answer (prefixscope_up = 1), 100 blocks of capacity each
  940  each worker stores its own 4-block chain in its KV cache (16 tokens per block)
  950  each worker serves one request on its chain: of 64 prompt tokens, w0 has 32 cached, w1 48,
       w2 16, w3 32 → effective cache value (4 blocks × 16 tokens × hit ratio) w2 16 < w0 32 < w1 48;
       the exporter ranks w2 first, the safest to remove
  965  the scrapes of w2 and w3 start failing (prefixscope_up = 0); a request on w0 at 966
       makes the exporter note since when they fail
  975  w3 still serves a request (32 cached; value 32): traffic reaches it, so it is *down*, not gone;
       w2 serves nothing after its scrapes failed: it has *left the pool*
  990  scrapes of w0 and w1 answer again

So the Workers page shows w0, w1 up, w3 down, w2 left the pool; w2 is neither ranked for
removal nor named as holding a hot branch, although the exporter still ranks it and its
blocks are still in the index.
"""

from __future__ import annotations

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, WorkerSnapshot
from prefixscope.thresholds import load_thresholds

NOW = 1_000.0
WORKERS = ("w0", "w1", "w2", "w3")
SHARED = [0x5151_0000_0000_0001, 0x5151_0000_0000_0002]  # a system prompt on every worker: the hot branch
CHAINS = {w: [*SHARED, 0x1000 * (i + 1) + 1, 0x1000 * (i + 1) + 2] for i, w in enumerate(WORKERS)}
CACHED = {"w0": 32, "w1": 48, "w2": 16, "w3": 32}  # of 64 prompt tokens


def _scrape(state: ClusterState, health: Health, worker: str, ts: float) -> None:
    health.set("prefixscope_up", (worker, "worker"), 1.0)
    state.observe_worker(WorkerSnapshot(worker, "vllm", model="m", prefix_queried_tokens=0.0,
                                        prefix_hit_tokens=0.0, num_gpu_blocks=100, block_size=16), ts)


def _record(ts: float, rid: str, worker: str) -> dict:
    return {"ts": ts, "request_id": rid, "worker": worker, "model": "m", "prompt_tokens": 64,
            "block_hashes": CHAINS[worker], "cached_tokens": CACHED[worker]}


def build_state() -> ClusterState:
    health = Health()
    state = ClusterState.build(health, load_thresholds(), clock=lambda: NOW)
    for w in WORKERS:
        _scrape(state, health, w, 900.0)
    for w in WORKERS:
        state.apply_kv_batch(KvBatch(w, 0, 940.0, (BlockStored(tuple(CHAINS[w]), None, 16),)), 940.0)
    state.ingest_records([_record(950.0 + i, f"a{i}", w) for i, w in enumerate(WORKERS)], 955.0)
    for w in ("w2", "w3"):
        health.set("prefixscope_up", (w, "worker"), 0.0)
    state.ingest_records([_record(966.0, "b0", "w0")], 966.0)
    state.ingest_records([_record(975.0, "c0", "w3")], 975.0)
    for w in ("w0", "w1"):
        _scrape(state, health, w, 990.0)
    state.refresh_tree_stats()
    return state
