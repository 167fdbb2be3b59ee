"""A real ClusterState on a 2-node topology in which worker w2 leaves the pool.

Every number the Prefix tree and Workers & topology pages show for it is computed by hand in
the tests; the inputs are laid out here. Times are relative to ``now`` (wall-clock seconds),
because the console asks /api/v1/changes for the windows ending 5 minutes ago and now.

Topology: node n0 (NVLink domain n0-d0: w0, w1 — H100, 1000 blocks) and node n1 (n1-d0:
w2, w3 — L40S, 400 blocks; w3 is the warm pool). Block size 16 tokens.

KV index (stored at now-560): system prompt S = S1 S2 on w0, w1, w2; branch A = A1 A2 A3
under S2 on w0, w1; branch B = B1 B2 under S2 on w2; an unrelated chain C = C1 C2 on w3.
  → 9 blocks; radix nodes S, A, B, C = 4; root fan-out 2 (S1, C1); S2 branches into 2.
  → replicas: S on 3 workers (2 blocks), A on 2 (3 blocks), B and C on 1 (4 blocks).

Records (cached tokens = what the engine reused; prompt = 16 × blocks unless noted):
  now-520.. before the pool change ("earlier" window of /changes)
    u0 web  w0  S A          cached 80 → branch A +80
    u1 web  w1  S A          cached 80 → branch A +80
    v0 web  w2  S B          cached 64 → branch B +64
    v1 web  w2  S B          cached 64 → branch B +64
    m0 mob. w3  C M1..M4     cached 32 → branch C +32
  now-425..now-421: plain requests on w0, w1, w3 only. w2 was last seen at now-517, more than
    60 s (health recency) before: the pool shrinks 4 → 3 at now-421 (epoch 1).
  now-30.. after the pool change ("later" window and the hot-branch window)
    u0 web  w0  S A A4       cached 80 → branch A +80
    u1 web  w1  S A A5       cached 80 → branch A +80
    v0 web  w0  S B B3       cached 32 (S only on w0) → branch S +32; migrated hard from w2
    v1 web  w3  S B B4       cached 0; migrated soft from w2 (same node n1)
    m0b mob. w3 C M1..M5     cached 32 → branch C +32; continues m0 under a new key (re-key)
    m1 mob. w3  C N1         cached 32 → branch C +32; a new conversation
"""

from __future__ import annotations

import time

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders
from prefixscope.thresholds import load_thresholds
from prefixscope.topology import parse_topology

BS = 16
S = [0x5151_0000_0000_0001, 0x5151_0000_0000_0002]
A = [0x1A1A_0000_0000_0001, 0x1A1A_0000_0000_0002, 0x1A1A_0000_0000_0003]
B = [0x1B1B_0000_0000_0001, 0x1B1B_0000_0000_0002]
C = [0x1C1C_0000_0000_0001, 0x1C1C_0000_0000_0002]
A4, A5 = 0x1A1A_0000_0000_0004, 0x1A1A_0000_0000_0005  # new turns' blocks: not in the KV index
B3, B4 = 0x1B1B_0000_0000_0003, 0x1B1B_0000_0000_0004
M = [0x4D4D_0000_0000_0000 + i for i in range(1, 6)]
N1 = 0x4E4E_0000_0000_0001

TOPOLOGY = {
    "schema": "prefixscope.topology/v1", "model": "m", "block_size": BS,
    "gpu_classes": {
        "H100": {"prefill_tps": 20000, "decode_tps": 100, "kv_blocks": 1000, "intra_node_gbps": 450,
                 "inter_node_gbps": 50, "price_per_gpu_hour": 4.0},
        "L40S": {"prefill_tps": 8000, "decode_tps": 60, "kv_blocks": 400, "intra_node_gbps": 64,
                 "inter_node_gbps": 25, "price_per_gpu_hour": 2.0}},
    "workers": [
        {"name": "w0", "node": "n0", "nvlink_domain": "n0-d0", "gpu_class": "H100"},
        {"name": "w1", "node": "n0", "nvlink_domain": "n0-d0", "gpu_class": "H100"},
        {"name": "w2", "node": "n1", "nvlink_domain": "n1-d0", "gpu_class": "L40S"},
        {"name": "w3", "node": "n1", "nvlink_domain": "n1-d0", "gpu_class": "L40S", "warm_pool": True}],
}


def _rec(ts: float, rid: str, worker: str, session: str | None, segment: str, chain: list[int],
         cached: int, **extra: object) -> dict:
    rec = {"ts": ts, "request_id": rid, "worker": worker, "model": "m", "prompt_tokens": BS * len(chain),
           "block_hashes": chain, "cached_tokens": cached, "session_key": session, "segment": segment}
    return rec | extra


def build_state(now: float) -> ClusterState:
    state = ClusterState.build(Health(), load_thresholds(), topology=parse_topology(TOPOLOGY, "test.yaml"),
                         clock=lambda: now)
    t = now - 560
    for worker, chain in (("w0", S + A), ("w1", S + A), ("w2", S + B), ("w3", C)):
        state.apply_kv_batch(KvBatch(worker, 0, t, (BlockStored(tuple(chain), None, BS),)), t)
    t = now - 520
    state.ingest_records([
        _rec(t, "p0", "w0", "u0", "web", S + A, 80),
        _rec(t + 1, "p1", "w1", "u1", "web", S + A, 80),
        _rec(t + 2, "p2", "w2", "v0", "web", S + B, 64),
        _rec(t + 3, "p3", "w2", "v1", "web", S + B, 64),
        _rec(t + 4, "p4", "w3", "m0", "mobile", C + M[:4], 32),
    ], t + 4)
    t = now - 425  # plain requests: no session, no hashes, no cached tokens
    state.ingest_records([{"ts": t + i, "request_id": f"k{i}", "worker": w, "model": "m", "prompt_tokens": BS}
                          for i, w in enumerate(("w0", "w1", "w3", "w0", "w1"))], t + 4)
    t = now - 30
    state.ingest_records([
        _rec(t, "q0", "w0", "u0", "web", S + A + [A4], 80),
        _rec(t + 1, "q1", "w1", "u1", "web", S + A + [A5], 80),
        _rec(t + 2, "q2", "w0", "v0", "web", S + B + [B3], 32, migrated_from="w2", migration_kind="hard"),
        _rec(t + 3, "q3", "w3", "v1", "web", S + B + [B4], 0, migrated_from="w2", migration_kind="soft"),
        _rec(t + 4, "q4", "w3", "m0b", "mobile", C + M, 32),
        _rec(t + 5, "q5", "w3", "m1", "mobile", [*C, N1], 32),
    ], t + 5)
    state.refresh_tree_stats()  # what the exporter's background refresher does within a second
    return state


def routes(now: float | None = None) -> dict:
    return ApiBuilders(build_state(time.time() if now is None else now)).routes()
