"""Resident blocks and hits per LoRA adapter and tenant: the simulated fleet's KV events over the
real codec into the state, compared with what the fleet's caches hold; bounds; records."""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest

from exporter.codecs import kvcodec
from exporter.codecs.kv_labels import salt_of
from exporter.config import Limits
from exporter.core.attribution import (
    ADAPTER_HIT,
    ADAPTER_QUERIED,
    ADAPTER_RESIDENT,
    NONE,
    TENANT_HIT,
    TENANT_QUERIED,
    TENANT_RESIDENT,
)
from exporter.core.cardinality import OTHER
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.web.exposition import render_state
from fleet.engine import SimEngine
from fleet.kv_publisher import encode_batch
from prefixscope.thresholds import load_thresholds
from tests.tenant_fleet import drive
from tests.tenant_fleet import held as truth


def state(limits: Limits | None = None) -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), clock=lambda: 0.0, limits=limits)


def run_fleet(encoding: str, hash_form: str = "int", attribution: bool = True, workers: int = 2,
              blocks: int = 900) -> tuple[ClusterState, list[SimEngine]]:
    """The tenants' workload (tests.tenant_fleet), every batch of KV events encoded as vLLM does,
    decoded by the exporter's codec, applied."""
    st = state()
    seqs: Counter[str] = Counter()

    def sink(name: str):
        def on_events(events, ts):
            payload = encode_batch(events, ts, encoding=encoding, hash_form=hash_form)
            batch = kvcodec.decode_batch(payload, name, seqs[name], st.health, attribution=attribution)
            seqs[name] += 1
            assert batch is not None
            st.apply_kv_batch(batch, ts)
        return on_events

    return st, drive(sink, workers, blocks)



def gauges(st: ClusterState, name: str) -> dict[str, float]:
    out: Counter[str] = Counter()
    for (label, medium), v in st.series().gauges.get(name, {}).items():
        assert medium == "GPU"
        out[label] += v
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_resident_blocks_per_adapter_and_tenant_equal_what_the_fleet_holds(encoding):
    st, engines = run_fleet(encoding)
    adapters, tenants = truth(engines)
    assert set(adapters) == {"billing-v2", "travel-v1", NONE}  # the workload covers every case
    assert set(tenants) == {"acme", "globex", "hooli", NONE}
    assert gauges(st, ADAPTER_RESIDENT) == adapters
    assert gauges(st, TENANT_RESIDENT) == tenants
    text = render_state(st).decode()
    assert 'prefixscope_tenant_resident_blocks{medium="GPU",tenant="acme"}' in text
    assert 'prefixscope_adapter_resident_blocks{adapter="travel-v1",medium="GPU"}' in text


def test_bytes_hashes_take_the_careful_path_and_are_attributed_alike():
    st, engines = run_fleet("array", hash_form="bytes", workers=1)
    adapters, tenants = truth(engines)
    assert gauges(st, ADAPTER_RESIDENT) == adapters
    assert gauges(st, TENANT_RESIDENT) == tenants


def test_attribution_off_reads_nothing_and_exports_nothing():
    st, _ = run_fleet("map", attribution=False, workers=1, blocks=2000)
    g = st.series().gauges
    assert ADAPTER_RESIDENT not in g and TENANT_RESIDENT not in g
    assert "prefixscope_tenant_resident_blocks{" not in render_state(st).decode()


def stored(hashes, parent=None, lora=None, extra=None) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": [1] * 16 * len(hashes), "block_size": 16, "lora_id": None, "medium": "GPU",
            "lora_name": lora, "extra_keys": extra if extra is not None else [None] * len(hashes)}


def apply(st: ClusterState, worker: str, seq: int, events: list) -> None:
    batch = kvcodec.decode_batch(msgpack.packb([float(seq), events, 0]), worker, seq, st.health, attribution=True)
    assert batch is not None
    st.apply_kv_batch(batch, float(seq))


def test_tenants_past_the_top_k_fold_into_other_and_totals_stay_whole():
    st = state(Limits(tenants=2, adapters=1))
    events = []
    for i, n in enumerate((5, 4, 3, 2, 1)):  # tenant t0 holds 5 blocks, t4 one
        root = 1000 * (i + 1)
        events.append(stored([root], extra=[[f"t{i}"]], lora=f"a{i}"))
        if n > 1:
            events.append(stored(range(root + 1, root + n), parent=root, lora=f"a{i}"))
    events.append(stored([9]))  # neither adapter nor salt
    apply(st, "w0", 0, events)
    assert st.series().gauges[TENANT_RESIDENT] == {("t0", "GPU"): 5, ("t1", "GPU"): 4, (OTHER, "GPU"): 6,
                                                   (NONE, "GPU"): 1}
    assert st.series().gauges[ADAPTER_RESIDENT] == {("a0", "GPU"): 5, (OTHER, "GPU"): 10, (NONE, "GPU"): 1}
    # evictions move the top-K: t0 loses four blocks, t2 is now second
    apply(st, "w0", 1, [{"type": "BlockRemoved", "block_hashes": [h]} for h in (1001, 1002, 1003, 1004)])
    assert st.series().gauges[TENANT_RESIDENT] == {("t1", "GPU"): 4, ("t2", "GPU"): 3, (OTHER, "GPU"): 4,
                                                   (NONE, "GPU"): 1}


def test_a_salt_is_read_from_the_root_block_and_inherited_along_the_chain_per_medium():
    st = state()
    apply(st, "w0", 0, [stored([1, 2], lora="sql", extra=[["sql", "acme"], ["sql"]]),
                        stored([3], parent=2, lora="sql", extra=[["sql"]]),
                        {**stored([2, 3], parent=1, lora="sql"), "medium": "CPU"},  # offloaded copies
                        stored([4], parent=99)])  # an unknown parent: no tenant
    assert st.series().gauges[TENANT_RESIDENT] == {("acme", "GPU"): 3, ("acme", "CPU"): 2, (NONE, "GPU"): 1}
    assert st.series().gauges[ADAPTER_RESIDENT] == {("sql", "GPU"): 3, ("sql", "CPU"): 2, (NONE, "GPU"): 1}
    st.worker_restarted("w0")  # the view is dropped: so are its labels
    apply(st, "w0", 1, [stored([7])])
    assert st.series().gauges[TENANT_RESIDENT] == {(NONE, "GPU"): 1, (NONE, "CPU"): 0}  # a known tier, empty


def test_what_counts_as_a_salt():
    assert salt_of(("acme",), None) == "acme"
    assert salt_of((3, "acme"), None) == "acme"  # vLLM 0.11: the LoRA id, then the salt
    assert salt_of(("sql",), "sql") is None  # vLLM 0.33: the adapter's name alone
    assert salt_of(("ab" * 32,), None) is None  # a multimodal content hash
    assert salt_of(("ab" * 32, 0), None) is None  # … with its offset
    assert salt_of(None, None) is None and salt_of((), None) is None


def test_hits_per_adapter_and_tenant_from_records_bounded_with_other():
    st = state(Limits(tenants=1, adapters=5))
    base = {"worker": "w0", "prompt_tokens": 100}
    st.ingest_records([{**base, "ts": 1, "request_id": "0", "cached_tokens": 50}], 1)  # nobody names tenants yet
    assert ADAPTER_QUERIED not in st.series().counters
    st.ingest_records([
        {**base, "ts": 2, "request_id": "1", "cached_tokens": 80, "lora_name": "sql", "tenant": "acme"},
        {**base, "ts": 3, "request_id": "2", "cached_tokens": 20, "tenant": "globex"},  # past the limit
        {**base, "ts": 4, "request_id": "3", "cached_tokens": 0},
        {**base, "ts": 5, "request_id": "4", "lora_name": "sql"},  # no cached_tokens: no hit to count
    ], 5)
    c = st.series().counters
    assert c[ADAPTER_QUERIED] == {("sql",): 100, (NONE,): 200}
    assert c[ADAPTER_HIT] == {("sql",): 80, (NONE,): 20}
    assert c[TENANT_QUERIED] == {("acme",): 100, (OTHER,): 100, (NONE,): 100}
    assert c[TENANT_HIT] == {("acme",): 80, (OTHER,): 20, (NONE,): 0}
    assert st.signals_locked()["attribution"]
    text = render_state(st).decode()
    assert 'prefixscope_tenant_prefix_cache_hit_tokens_total{tenant="acme"} 80.0' in text
