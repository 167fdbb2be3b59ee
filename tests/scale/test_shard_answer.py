"""N family shards (full ClusterStates behind ShardSink and ShardRecords) give one exporter's answer:
every counter and histogram on /metrics sums over shards to the single exporter's, prefix
instability included (a root and its near-duplicate twin on different shards), and the checks'
ratios computed from the summed series are the single exporter's."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

import pytest

from exporter.bootstrap import ExporterParts, bootstrap, family_sink
from exporter.config import Config, NatsKv, Shard
from exporter.core.checks import evaluate
from exporter.core.sharding import ShardRecords, ShardSink, ShardSpec, family_shard, record_shard
from exporter.model import BlockRemoved, BlockStored, KvBatch
from prefixscope.records import RequestRecord
from tests.scale.shards_as_one import ShardsAsOne, pooled_differences, samples

BS = 4
T0 = 1_700_000_000.0
WORKERS = [f"w{i}" for i in range(4)]
@dataclass
class Exp:
    parts: ExporterParts
    kv: ShardSink | object
    records: ShardRecords | object


def exporter(spec: ShardSpec, clock: list[float]) -> Exp:
    # a shard reads every worker's KV events from NATS (the relay's stream), through its family filter
    cfg = Config(shard=Shard(spec.index, spec.count), kv_nats=NatsKv(url="nats://127.0.0.1:4222")) \
        if spec.sharded else Config()
    parts = bootstrap(cfg, clock=lambda: clock[0])
    st = parts.state
    if not spec.sharded:
        return Exp(parts, st, st)
    return Exp(parts, family_sink(st, spec, parts.health), ShardRecords(st, spec))


def chain(tokens: list[int]) -> list[int]:
    out, p = [], None
    for b in range(len(tokens) // BS):
        p = hash((p, tuple(tokens[b * BS:(b + 1) * BS]))) & ((1 << 63) - 1)
        out.append(p)
    return out


def workload(seed: int, steps: int = 500):
    """Sessions that keep their system prompt (their chain's root) and grow turn by turn; some
    requests render a timestamp into their system prompt (a new root each time, a near-duplicate
    of the stable one); workers evict leaf first, one block per BlockRemoved as vLLM does."""
    rng = random.Random(seed)
    systems = [[1000 * s + i for i in range(BS * 12)] for s in range(5)]
    sessions: dict[str, tuple[list[int], str]] = {}
    held: dict[str, list[list[int]]] = {w: [] for w in WORKERS}
    cached: dict[str, set[int]] = {w: set() for w in WORKERS}
    seq: Counter[str] = Counter()
    for step in range(steps):
        ts = T0 + step * 0.5
        key = f"s{rng.randint(0, 40)}"
        unstable = rng.random() < 0.25
        if unstable:
            toks = [rng.randint(1, 10**6)] * BS + systems[0][BS:]  # the same prompt but its first block
            key = None
            w = rng.choice(WORKERS)
        else:
            hist, w0 = sessions.get(key, (list(rng.choice(systems)), rng.choice(WORKERS)))
            w = w0 if rng.random() < 0.8 else rng.choice(WORKERS)  # some follow-ups collide
            toks = hist + [rng.randint(1, 50000) for _ in range(BS * rng.randint(1, 3))]
            sessions[key] = (toks, w)
        hashes = chain(toks)
        mine = cached[w]
        start = 0
        while start < len(hashes) and hashes[start] in mine:
            start += 1
        evs: list = []
        if start < len(hashes):
            evs.append(BlockStored(tuple(hashes[start:]), hashes[start - 1] if start else None, BS,
                                   (len(hashes) - start) * BS, "GPU", token_ids=tuple(toks[start * BS:len(hashes) * BS])))
            mine.update(hashes[start:])
            held[w].append(hashes[start:])
        while len(mine) > 60 and held[w]:  # evict the oldest run, leaf first
            run = held[w].pop(0)
            for h in reversed(run):
                if h in mine and not any(h in r for r in held[w]):
                    mine.discard(h)
                    evs.append(BlockRemoved((h,), "GPU"))
        batch = KvBatch(w, seq[w], ts, tuple(evs))
        seq[w] += 1
        rec = RequestRecord(ts=ts, request_id=f"r{step}", worker=w, prompt_tokens=len(toks), session_key=key,
                            block_hashes=tuple(hashes), cached_tokens=start * BS, ttft_s=0.05 + rng.random() / 10,
                            prefill_s=rng.random(), predicted_cached_tokens=start * BS)
        yield ts, batch, rec


def run(seed: int, count: int) -> tuple[Exp, list[Exp]]:
    clock = [T0]
    single = exporter(ShardSpec(), clock)
    shards = [exporter(ShardSpec(i, count), clock) for i in range(count)]
    for ts, batch, rec in workload(seed):
        clock[0] = ts
        single.kv.apply_kv_batch(batch, ts)
        single.records.ingest_records([rec], ts)
        for s in shards:
            s.kv.apply_kv_batch(batch, ts)
            s.records.ingest_records([rec], ts)  # every shard is sent every record
    return single, shards


@pytest.mark.parametrize("seed", [1, 2])
def test_every_series_sums_over_shards_to_one_exporter(seed: int) -> None:
    single, shards = run(seed, 3)
    diffs, compared = pooled_differences(samples(single.parts.collector),
                                         [samples(s.parts.collector) for s in shards])
    assert not diffs
    assert compared > 40
    # the workload exercised what the shards had to get right
    one = samples(single.parts.collector)
    assert one[("prefixscope_prefix_unstable_root_branches_total", ())] > 0
    assert one[("prefixscope_sticky_collisions_total", (("model", "unknown"),))] > 0
    for s in shards:  # every shard owns roots and records
        assert s.parts.state.store.window_counter("prefixscope_prefix_root_branches") and s.parts.state.store.window_counter("prefixscope_requests")


def test_hot_branches_merge_to_one_exporters_top_k() -> None:
    """Each branch lives on one shard, so the top K of the shards' top-K lists is one exporter's."""
    single, shards = run(3, 3)

    def top(parts: ExporterParts) -> dict[str, float]:
        return {dict(k[1])["branch"]: v for k, v in samples(parts.collector).items()
                if k[0] == "prefixscope_hot_branch_hit_tokens"}
    want = top(single.parts)
    merged: dict[str, float] = {}
    for s in shards:
        merged.update(top(s.parts))
    best = dict(sorted(merged.items(), key=lambda kv: -kv[1])[:len(want)])
    assert sorted(best.values()) == sorted(want.values())


def test_a_record_goes_to_one_shard() -> None:
    rec = RequestRecord(ts=T0, request_id="r", worker="w0", prompt_tokens=8, block_hashes=(7, 8))
    assert record_shard(rec, 4) == family_shard(7, 4)
    no_hashes = RequestRecord(ts=T0, request_id="r", worker="w0", prompt_tokens=8, session_key="abc")
    assert record_shard(no_hashes, 4) == record_shard(RequestRecord(ts=T0, request_id="q", worker="w3",
                                                                    prompt_tokens=9, session_key="abc"), 4)


def test_checks_and_the_verdict_over_the_shards_are_one_exporters() -> None:
    """The catalogue's checks evaluated over the shards' series as Prometheus pools them equal one
    exporter's: every value (ratios exactly, quantiles on the same bucket sums), every status, the
    steps and the chain's verdict — what /api/v1/groups reports, and what the console shows."""
    single, shards = run(4, 3)
    for e in [single, *shards]:
        e.parts.state.refresh_tree_stats()  # the background pass, now
    one = evaluate(single.parts.state)
    many = evaluate(ShardsAsOne([s.parts.state for s in shards]))  # type: ignore[arg-type]
    compared = 0
    for key, r in one.results.items():
        got = many.results[key]
        assert got.status == r.status, key
        if r.value is None:
            assert got.value is None, key
        else:
            assert got.value is not None and math.isclose(got.value, r.value, rel_tol=1e-9, abs_tol=1e-12), key
            compared += 1
    assert compared >= 9, [k for k, r in one.results.items() if r.value is not None]
    assert many.step_status == one.step_status and many.verdict == one.verdict
    assert {k: v for k, v in many.reuse.items()} == pytest.approx(one.reuse)


def test_records_of_other_shards_reach_the_cold_baseline_in_the_streams_order() -> None:
    """A shard keeps its records and hands the others to its cold-prefill baseline only, in runs
    that keep the stream's order (the miss-cost SLO judges against the cluster's baseline)."""
    calls: list[tuple[str, list[str]]] = []

    class Sink:
        def ingest_records(self, records, received_at) -> None:
            calls.append(("kept", [r.request_id for r in records]))

        def observe_cold_baselines(self, records, received_at) -> None:
            calls.append(("baseline", [r.request_id for r in records]))

        def signal_seen(self, signal, ts) -> None:
            pass

    recs = [RequestRecord(ts=T0, request_id=f"r{i}", worker="w0", prompt_tokens=8, block_hashes=(i,))
            for i in range(40)]
    ShardRecords(Sink(), ShardSpec(1, 3)).ingest_records(recs, T0)
    assert [rid for _, ids in calls for rid in ids] == [r.request_id for r in recs]
    for kind, ids in calls:
        for rid in ids:
            assert (record_shard(recs[int(rid[1:])], 3) == 1) == (kind == "kept")
    assert {k for k, _ in calls} == {"kept", "baseline"}
    assert all(a[0] != b[0] for a, b in pairwise(calls))  # runs, not one call per record
