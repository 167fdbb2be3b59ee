"""Resident blocks per LoRA adapter and tenant over family shards: every shard decodes every batch
(as each NATS consumer does), keeps the labelled blocks of its own families and counts the rest of
each worker against its own part of the index — so the shards' gauges add up to one exporter's and
to what the simulated fleet's caches hold."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable

from exporter import kvcodec
from exporter.attribution import ADAPTER_RESIDENT, NONE, TENANT_RESIDENT
from exporter.health import Health
from exporter.model import KvBatch
from exporter.sharding import ShardSink, ShardSpec, SharedRoots
from exporter.state import ClusterState
from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, SimEngine, WorkerSpec
from fleet.kv_publisher import encode_batch
from fleet.router import import_prefix
from fleet.workloads import WorkloadGenerator, WorkloadParams
from prefixscope.thresholds import load_thresholds

SHARDS = 3
TENANTS = {"tenants": 4, "tenant_loras": ("billing-v2", None, "billing-v2", "travel-v1"),
           "tenant_salts": ("acme", "globex", None, "hooli"), "fork_prob": 0.3, "chat_sessions_per_s": 1.0,
           "system_tokens": 800, "tool_tokens": 200, "cold_prompt_tokens": (1000, 2000), "doc_tokens": (2000, 4000),
           "docqa_tokens": (1000, 2000), "extract_tokens": (2000, 3000), "doc_per_s": 0.05}


def new_state() -> ClusterState:
    return ClusterState(Health(), load_thresholds(), clock=lambda: 0.0)


def shard(i: int) -> tuple[ClusterState, ShardSink]:
    st = new_state()
    st.roots = SharedRoots(st.roots.window_s, st.roots.max_roots)
    return st, ShardSink(st, ShardSpec(i, SHARDS), health=st.health, roots=st.roots, stream_aware=True,
                         attribution=st.attribution.kv)


def run(workers: int = 3, blocks: int = 900) -> tuple[ClusterState, list[ClusterState], list[SimEngine]]:
    single = new_state()
    shards = [shard(i) for i in range(SHARDS)]
    consumers: list[tuple[Health, Callable[[KvBatch, float], None]]] = [
        (single.health, single.apply_kv_batch), *((st.health, sink.apply_kv_batch) for st, sink in shards)]
    clock = VirtualClock()
    seqs: Counter[str] = Counter()

    def sink(name: str):
        def on_events(events, ts):
            payload = encode_batch(events, ts, encoding="map")
            for health, apply in consumers:
                batch = kvcodec.decode_batch(payload, name, seqs[name], health, attribution=True)
                assert batch is not None
                apply(batch, ts)
            seqs[name] += 1
        return on_events

    engines = [SimEngine(WorkerSpec(f"w{i}", num_gpu_blocks=blocks), clock, sink(f"w{i}")) for i in range(workers)]
    gen = WorkloadGenerator([(0.0, WorkloadParams().with_overrides(TENANTS))], 120, seed=7)
    for eng in engines:
        for i, shared in enumerate(gen.shared_prompts()):
            import_prefix(eng, f"prewarm-{i}", shared.block_hashes, shared.token_ids, shared.lora_name,
                          shared.lora_id, shared.cache_salt)
    for r in gen.requests():
        eng = engines[zlib.crc32(r.conversation.encode()) % workers]
        res = eng.execute(EngineRequest(r.request_id, token_ids=r.token_ids, block_hashes=r.block_hashes,
                                        max_tokens=1, lora_name=r.lora_name, lora_id=r.lora_id,
                                        cache_salt=r.cache_salt))
        clock.advance(res.e2e_s + 0.01)
        for e in engines:
            e.tick()
    return single, [st for st, _ in shards], engines


def gauge(states: list[ClusterState], name: str) -> dict[str, float]:
    out: Counter[str] = Counter()
    for st in states:
        for (label, _medium), v in st.series().gauges.get(name, {}).items():
            out[label] += v
    return {k: v for k, v in out.items() if v}


def test_shards_attribute_their_families_and_add_up_to_one_exporter() -> None:
    single, shards, engines = run()
    adapters: Counter[str] = Counter()
    tenants: Counter[str] = Counter()
    for eng in engines:
        for (lora, salt), n in eng.cache.resident_by_label().items():
            adapters[lora or NONE] += n
            tenants[salt or NONE] += n
    assert set(adapters) == {"billing-v2", "travel-v1", NONE} and set(tenants) == {"acme", "globex", "hooli", NONE}
    for name, truth in ((ADAPTER_RESIDENT, dict(adapters)), (TENANT_RESIDENT, dict(tenants))):
        assert gauge([single], name) == truth
        assert gauge(shards, name) == truth, name
    # the labelled blocks are spread over the shards, each holding only its own families'
    holding = [st for st in shards if any(k[0] != NONE and v for k, v in st.series().gauges[ADAPTER_RESIDENT].items())]
    assert len(holding) >= 2
