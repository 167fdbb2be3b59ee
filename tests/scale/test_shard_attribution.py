"""Resident blocks per LoRA adapter and tenant over family shards: every shard decodes every batch
(as each NATS consumer does), keeps the labelled blocks of its own families and counts the rest of
each worker against its own part of the index — so the shards' gauges add up to one exporter's and
to what the simulated fleet's caches hold."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from exporter.bootstrap import family_sink
from exporter.codecs import kvcodec
from exporter.core.attribution import ADAPTER_RESIDENT, NONE, TENANT_RESIDENT
from exporter.core.health import Health
from exporter.core.sharding import ShardSink, ShardSpec, SharedRoots
from exporter.core.state import ClusterState
from exporter.model import KvBatch
from fleet.engine import SimEngine
from fleet.kv_publisher import encode_batch
from prefixscope.thresholds import load_thresholds
from tests.tenant_fleet import drive, held

SHARDS = 3


def new_state() -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), clock=lambda: 0.0)


def shard(i: int) -> tuple[ClusterState, ShardSink]:
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 0.0, roots=SharedRoots(300.0))
    return st, family_sink(st, ShardSpec(i, SHARDS), st.health)


def run(workers: int = 3) -> tuple[ClusterState, list[ClusterState], list[SimEngine]]:
    single = new_state()
    shards = [shard(i) for i in range(SHARDS)]
    consumers: list[tuple[Health, Callable[[KvBatch, float], None]]] = [
        (single.health, single.apply_kv_batch), *((st.health, sink.apply_kv_batch) for st, sink in shards)]
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

    return single, [st for st, _ in shards], drive(sink, workers, seed=7)


def gauge(states: list[ClusterState], name: str) -> dict[str, float]:
    out: Counter[str] = Counter()
    for st in states:
        for (label, _medium), v in st.series().gauges.get(name, {}).items():
            out[label] += v
    return {k: v for k, v in out.items() if v}


def test_shards_attribute_their_families_and_add_up_to_one_exporter() -> None:
    single, shards, engines = run()
    adapters, tenants = held(engines)
    assert set(adapters) == {"billing-v2", "travel-v1", NONE} and set(tenants) == {"acme", "globex", "hooli", NONE}
    for name, truth in ((ADAPTER_RESIDENT, adapters), (TENANT_RESIDENT, tenants)):
        assert gauge([single], name) == truth
        assert gauge(shards, name) == truth, name
    # the labelled blocks are spread over the shards, each holding only its own families'
    holding = [st for st in shards if any(k[0] != NONE and v for k, v in st.series().gauges[ADAPTER_RESIDENT].items())]
    assert len(holding) >= 2
