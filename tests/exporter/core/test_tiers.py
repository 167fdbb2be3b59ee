"""Cache tiers: resident blocks and capacity per medium, what the offload tier serves, LMCache."""

from __future__ import annotations

import msgpack
import msgspec

from exporter.codecs import kvcodec
from exporter.codecs.normalize import parse_worker
from exporter.core import checks, culprits
from exporter.core.health import Health
from exporter.core.index.tiers import medium_capacity, offload_hit_tokens
from exporter.core.state import ClusterState
from exporter.web import api
from exporter.web.exposition import render_state
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds


def page(extra: str = "", blocks: int = 1000) -> str:
    return f"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0
{extra}"""


OFFLOAD = """# TYPE vllm:kv_offload_cpu_cache_usage_perc gauge
vllm:kv_offload_cpu_cache_usage_perc{{engine="0",model_name="m"}} {usage}
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="m",source="device"}} {device}
vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="m",source="host"}} {host}
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{{engine="0",model_name="m"}} {ext_q}
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} {ext_h}
"""


def kv(st: ClusterState, seq: int, events: list) -> None:
    batch = kvcodec.decode_batch(msgpack.packb([float(seq), events, 0]), "w0", seq, st.health)
    assert batch is not None
    st.apply_kv_batch(batch, 100.0 + seq)


def stored(hashes, medium="GPU", parent=None) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": [], "block_size": 16, "medium": medium}


def test_resident_and_capacity_per_medium_and_what_the_offload_tier_serves():
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 130.0)
    kv(st, 0, [stored(range(1, 301)), stored(range(1, 201), "CPU"), stored(range(500, 540), "CPU")])
    for t, (device, host, ext_q, ext_h) in ((100.0, (0, 0, 0, 0)), (110.0, (800, 320, 1000, 320))):
        snap, errors = parse_worker("w0", page(OFFLOAD.format(usage=0.4, device=device, host=host, ext_q=ext_q,
                                                              ext_h=ext_h)))
        assert errors == [] and snap.offload_usage_ratio == {"CPU": 0.4}
        st.observe_worker(snap, t)
    g = st.series().gauges
    assert g["prefixscope_worker_medium_resident_blocks"] == {("w0", "GPU"): 300, ("w0", "CPU"): 240}
    # the CPU tier's capacity: 240 blocks held at 40 % used
    assert g["prefixscope_worker_medium_capacity_blocks"] == {("w0", "GPU"): 1000, ("w0", "CPU"): 600}
    assert g["prefixscope_worker_offload_usage_ratio"] == {("w0", "CPU"): 0.4}
    text = render_state(st).decode()
    assert 'prefixscope_worker_medium_capacity_blocks{medium="CPU",worker="w0"} 600.0' in text
    [row] = api.workers(st)["workers"]
    assert row["resident_blocks_by_medium"] == {"GPU": 300, "CPU": 240}
    assert row["capacity_blocks_by_medium"] == {"GPU": 1000.0, "CPU": 600}
    assert row["hit_tokens_by_tier"] == {"device": 800.0, "host": 320.0}  # in the window
    assert (row["external_queried_tokens"], row["external_hit_tokens"]) == (1000.0, 320.0)


def test_an_offload_capacity_is_estimated_only_from_a_meaningful_share():
    assert medium_capacity(100, {"CPU": 0.5}, {"CPU": 10}) == {"GPU": 100.0, "CPU": 20}
    assert medium_capacity(100, {"CPU": 0.01}, {"CPU": 10}) == {"GPU": 100.0}  # 1 %: too noisy
    assert medium_capacity(None, {"CPU": 0.5}, {}) == {}  # nothing held: unknown, not 0
    assert offload_hit_tokens({"device": 5.0, "host": 2.0, "disk": 1.0}) == 3.0
    assert offload_hit_tokens(None) is None


def test_lmcache_hits_stand_in_for_external_hits_only_where_vllm_has_none():
    lmcache = """# TYPE lmcache:num_requested_tokens_total counter
lmcache:num_requested_tokens_total{model_name="m",worker_id="0"} 500.0
# TYPE lmcache:num_hit_tokens_total counter
lmcache:num_hit_tokens_total{model_name="m",worker_id="0"} 125.0
"""
    snap, errors = parse_worker("w0", page(lmcache))
    assert errors == [] and (snap.external_queried_tokens, snap.external_hit_tokens) == (500.0, 125.0)
    both = lmcache + OFFLOAD.format(usage=0.1, device=0, host=0, ext_q=40, ext_h=10)
    snap, _ = parse_worker("w0", page(both))
    assert (snap.external_queried_tokens, snap.external_hit_tokens) == (40.0, 10.0)  # vLLM's own win
    snap, _ = parse_worker("w0", page())
    assert snap.external_hit_tokens is None and snap.offload_usage_ratio is None  # missing, never 0


# ---- GPU capacity against GPU blocks, every tier on its own ------------------------------------
# Frames as vLLM's own classes encode them (vllm/distributed/kv_events.py, v0.33.0: msgspec Structs
# with tag=True, omit_defaults=True, the batch array_like; MEDIUM_CPU "CPU", MEDIUM_STORAGE "STORAGE").
class _Event(msgspec.Struct, array_like=False, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


def vllm_frame(ts: float, events: list) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts, events, 0))


def test_gpu_fill_and_the_thrash_gate_count_gpu_blocks_only():
    """500 GPU blocks beside 2,000 on CPU and 300 on disk, on a 1,000-block GPU: 50 % full, not 280 %;
    the thrash of 50 re-stored GPU blocks is not that of a full cache; each tier has its own series."""
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 130.0)

    def apply(seq: int, events: list) -> None:
        batch = kvcodec.decode_batch(vllm_frame(float(seq), events), "w0", seq, st.health)
        assert batch is not None
        st.apply_kv_batch(batch, 100.0 + seq)

    def stored(hashes, medium):
        return BlockStored(list(hashes), None, [], 16, None, medium)

    apply(0, [stored(range(1, 501), "GPU"), stored(range(1001, 3001), "CPU"), stored(range(4001, 4301), "STORAGE")])
    apply(1, [BlockRemoved(list(range(1, 51)), "GPU")])
    apply(2, [stored(range(1, 51), "GPU")])  # evicted, then stored again: thrash
    for t in (100.0, 110.0):
        snap, errors = parse_worker("w0", page())
        assert errors == []
        st.observe_worker(snap, t)
    series = st.series()
    g = series.gauges
    assert g["prefixscope_worker_resident_blocks"] == {("w0",): 500}
    assert g["prefixscope_worker_medium_resident_blocks"] == {("w0", "GPU"): 500, ("w0", "CPU"): 2000,
                                                                ("w0", "STORAGE"): 300}
    assert g["prefixscope_worker_capacity_blocks"] == {("w0",): 1000}
    result = checks.evaluate(st).results["prefix_block_count_per_worker"]
    assert result.value == 0.0  # thrash, but of a half-full cache: the gate is shut
    [row] = api.workers(st)["workers"]
    assert row["resident_blocks"] == 500 and row["resident_blocks_by_medium"] == {"GPU": 500, "CPU": 2000, "STORAGE": 300}
    ranking = culprits._series(st, catalog.CHECKS_BY_KEY["prefix_block_count_per_worker"])
    assert ranking.values == {"w0": 0.5}
