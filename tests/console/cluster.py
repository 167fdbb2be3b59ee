"""A real ClusterState fed with crafted inputs: sticky sessions fail while the hit rate falls.

Hand-computed: worker scrapes give 246 + 164 hit of 600 + 400 queried tokens → 41% (the
symptom). Ten keyed sessions each send two turns; sessions 0–2 come back on w1 while their
worker w0 is still healthy → 3 of 10 follow-ups collide → 30% (> 5%: step 2 fires).
Follow-ups on w0 reuse all 64 prompt tokens, those on w1 only its 2 resident blocks (32).

The thresholds keep their values but every ``for`` is 0 s, as in the Prometheus fixture: a breach
fires at once, so the crafted state (evaluated at one fixed instant) shows firing alerts.
"""

from __future__ import annotations

from dataclasses import replace

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, WorkerSnapshot
from exporter.web.api import ApiBuilders
from prefixscope.thresholds import CheckThreshold, Thresholds, load_thresholds

NOW = 1_000.0
CHAIN = [11, 12, 13, 14]


def firing_at_once(th: Thresholds) -> Thresholds:
    """The thresholds with every alert's ``for`` at 0 s."""
    return replace(th, checks={k: CheckThreshold(c.value, "0s", c.severity) for k, c in th.checks.items()})


def build_state(thresholds: Thresholds | None = None) -> ClusterState:
    th = firing_at_once(load_thresholds()) if thresholds is None else thresholds
    state = ClusterState.build(Health(), th, clock=lambda: NOW)
    for worker, (queried, hits) in {"w0": (600, 246), "w1": (400, 164)}.items():
        for ts, share in ((900.0, 0.0), (990.0, 1.0)):
            state.observe_worker(WorkerSnapshot(worker, "vllm", model="m", prefix_queried_tokens=queried * share,
                                                prefix_hit_tokens=hits * share, num_gpu_blocks=100,
                                                block_size=16), ts)
    state.apply_kv_batch(KvBatch("w0", 0, 940.0, (BlockStored(tuple(CHAIN), None, 16),)), 940.0)
    state.apply_kv_batch(KvBatch("w1", 0, 940.0, (BlockStored(tuple(CHAIN[:2]), None, 16),)), 940.0)
    first = [{"ts": 950.0 + i, "request_id": f"a{i}", "worker": "w0", "model": "m", "prompt_tokens": 64,
              "session_key": f"s{i}", "block_hashes": CHAIN, "cached_tokens": 0} for i in range(10)]
    follow = [{"ts": 970.0 + i, "request_id": f"b{i}", "worker": "w1" if i < 3 else "w0", "model": "m",
               "prompt_tokens": 64, "session_key": f"s{i}", "block_hashes": CHAIN,
               "cached_tokens": 32 if i < 3 else 64} for i in range(10)]
    state.ingest_records(first, 960.0)
    state.ingest_records(follow, 985.0)
    state.refresh_tree_stats()  # what the exporter's background refresher does within a second
    return state


def routes() -> dict:
    return ApiBuilders(build_state()).routes()


def build_recovered_state(thresholds: Thresholds | None = None) -> ClusterState:
    """The same cluster after its fault ended: from 1 000 s ten new sessions come back on the
    worker that served them (no collision), the workers report healthy hits and stream KV events.
    Over the 5-minute window the collisions still read 3 of 20 follow-ups (15%, past 5%); over
    the last minute none."""
    state = build_state(thresholds)
    first = [{"ts": 1001.0 + i, "request_id": f"c{i}", "worker": "w0", "model": "m", "prompt_tokens": 64,
              "session_key": f"t{i}", "block_hashes": CHAIN, "cached_tokens": 64} for i in range(10)]
    follow = [{"ts": 1040.0 + i, "request_id": f"d{i}", "worker": "w0", "model": "m", "prompt_tokens": 64,
               "session_key": f"t{i}", "block_hashes": CHAIN, "cached_tokens": 64} for i in range(10)]
    state.ingest_records(first, 1011.0)
    state.ingest_records(follow, 1050.0)
    for worker, (queried, hits) in {"w0": (600, 246), "w1": (400, 164)}.items():
        state.observe_worker(WorkerSnapshot(worker, "vllm", model="m", prefix_queried_tokens=queried + 1000,
                                            prefix_hit_tokens=hits + 950, num_gpu_blocks=100, block_size=16), 1050.0)
    for seq, worker in enumerate(("w0", "w1")):
        state.apply_kv_batch(KvBatch(worker, 1, 1050.0, (BlockStored((21 + seq,), None, 16),)), 1050.0)
    return state
