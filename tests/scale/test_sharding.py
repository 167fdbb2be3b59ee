"""Shards by prefix family give one answer: the union of N shard indexes equals one index."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from exporter.core.index.prefix_index_ref import (
    ReferencePrefixIndex as PrefixIndex,  # the semantics (the compiled core equals it)
)
from exporter.core.sharding import (
    ShardSink,
    ShardSpec,
    combined_match,
    family_shard,
    home_shard,
    merge_tree_stats,
    owner_of_chain,
    plan,
)
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvBatch, KvEvent

WORKERS = [f"w{i}" for i in range(5)]


class IndexSink:
    """The KV half of a state: just an index (what the equality is about)."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.batches: Counter[str] = Counter()
        self.events: Counter[tuple[str, str]] = Counter()

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        self.batches[batch.worker] += 1
        for ev in batch.events:
            self.events[(batch.worker, type(ev).__name__)] += 1
        self.index.apply(batch.worker, batch.events)

    def worker_restarted(self, worker: str) -> None:
        self.index.clear_worker(worker)


def chains(rng: random.Random, roots: int, depth: int) -> list[list[int]]:
    """Request chains sharing prefixes: each root has a few branches (block hash = a fresh int)."""
    out = []
    nxt = iter(range(1, 10**9))
    for _ in range(roots):
        trunk = [next(nxt) for _ in range(rng.randint(1, depth))]
        for _ in range(rng.randint(1, 4)):
            out.append(trunk + [next(nxt) for _ in range(rng.randint(0, depth))])
    return out


def stream(seed: int, n: int = 600, media: tuple[str, ...] = ("GPU",)) -> list[KvBatch]:
    """A random interleaving of workers caching chain prefixes, evicting and clearing, as vLLM does:
    a run continues from a block the worker holds (or starts a chain), and a worker evicts a
    chain's blocks leaf first (vLLM frees a request's blocks tail first)."""
    rng = random.Random(seed)
    cs = chains(rng, 25, 6)
    parent_of = {c[i]: (c[i - 1] if i else None) for c in cs for i in range(len(c))}
    held: dict[tuple[str, str], set[int]] = {(w, m): set() for w in WORKERS for m in media}
    seqs: Counter[str] = Counter()
    out = []
    for _ in range(n):
        w = rng.choice(WORKERS)
        evs: list[KvEvent] = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            medium = rng.choice(media)
            mine = held[(w, medium)]
            if r < 0.6:
                c = rng.choice(cs)
                k = rng.randint(1, len(c))
                start = 0
                while start < k - 1 and c[start] in mine:
                    start += 1
                evs.append(BlockStored(tuple(c[start:k]), c[start - 1] if start else None, 16, 16 * (k - start), medium))
                mine.update(c[start:k])
            elif r < 0.97 and mine:
                leaves = sorted(mine - {parent_of[h] for h in mine})
                h = rng.choice(leaves)
                mine.discard(h)
                evs.append(BlockRemoved((h,), medium))
            elif r < 0.99:
                evs.append(BlockRemoved((rng.randint(1, 400),), medium))  # unknown removal
            else:
                for m in media:
                    held[(w, m)].clear()
                evs.append(AllBlocksCleared())
        out.append(KvBatch(w, seqs[w], 0.0, tuple(evs)))
        seqs[w] += 1
    return out


def run(batches: list[KvBatch], count: int) -> tuple[IndexSink, list[ShardSink]]:
    single = IndexSink()
    shards = [ShardSink(IndexSink(), ShardSpec(i, count)) for i in range(count)]
    for b in batches:
        single.apply_kv_batch(b, 0.0)
        for s in shards:
            s.apply_kv_batch(b, 0.0)
    return single, shards


def match(m) -> tuple[int, dict[str, int]]:
    return m.blocks, dict(m.per_worker)


def sorted_stats(s):
    return (s.nodes, s.blocks, s.root_fanout, dict(s.leaf_depths), dict(s.leaf_block_depths),
            dict(s.fanouts), dict(s.replicas), set(s.branching))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("count", [2, 3])
def test_shards_add_up_to_one_index(seed: int, count: int) -> None:
    batches = stream(seed)
    single, shards = run(batches, count)
    parts = [s.state.index for s in shards]
    # resident blocks per worker
    total: Counter[str] = Counter()
    for ix in parts:
        total.update(ix.resident_by_worker())
    assert +total == +Counter(single.index.resident_by_worker())
    # every block in exactly one shard, with the same holders
    for h in range(1, 2000):
        owners = [ix for ix in parts if h in ix]
        assert len(owners) <= 1
        assert sorted(owners[0].holders(h) if owners else []) == sorted(single.index.holders(h))
    # tree statistics: the merged distributions are the single index's
    assert sorted_stats(merge_tree_stats(ix.stats() for ix in parts)) == sorted_stats(single.index.stats())
    # stored events add up (no run crosses families in a loss-free stream); unknown removals counted once
    stored = Counter()
    for s in shards:
        stored.update({k: v for k, v in s.state.events.items() if k[1] != "AllBlocksCleared"})
    assert stored == Counter({k: v for k, v in single.events.items() if k[1] != "AllBlocksCleared"})
    # batches: each worker's batches reach its home shard every time
    for w in WORKERS:
        assert shards[home_shard(w, count)].state.batches[w] == single.batches[w]


@pytest.mark.parametrize("seed", range(4))
def test_available_lookups_are_exact(seed: int) -> None:
    count = 3
    batches = stream(seed)
    single, shards = run(batches, count)
    rng = random.Random(seed + 100)
    cs = chains(random.Random(seed), 25, 6)
    for c in cs + [rng.sample(range(1, 300), 5) for _ in range(20)]:
        want = match(single.index.longest_match(c))
        assert match(combined_match([s.state.index for s in shards], c)) == want
        owner = owner_of_chain(shards[0].router, c)
        if c not in cs:  # not a real chain (its blocks are not parent and child): only the combined lookup holds
            continue
        if owner is not None:
            assert match(shards[owner].state.index.longest_match(c)) == want
        else:
            assert want[0] == 0


def test_tiers_and_orphans_stay_exact() -> None:
    """Two media, and runs whose parent nobody holds (a late join): still one answer."""
    batches = stream(7, media=("GPU", "CPU"))
    batches.insert(50, KvBatch("w0", 999, 0.0, (BlockStored((10**6, 10**6 + 1), 10**7, 16, 32),)))
    single, shards = run(batches, 3)
    total: Counter[str] = Counter()
    for s in shards:
        total.update(s.state.index.resident_by_worker())
    assert +total == +Counter(single.index.resident_by_worker())
    assert sorted_stats(merge_tree_stats(s.state.index.stats() for s in shards)) == sorted_stats(single.index.stats())


def test_every_router_agrees_on_families() -> None:
    """All shards run the same router over the same stream: their family tables are equal."""
    _, shards = run(stream(3), 3)
    tables = [dict(s.router._family) for s in shards]
    assert tables[0] == tables[1] == tables[2]
    assert len(shards[0].router) == sum(len(s.state.index) for s in shards)


def test_rules_are_stable_and_spread() -> None:
    assert home_shard("worker-7", 4) == home_shard("worker-7", 4)
    spread = Counter(family_shard(h, 4) for h in range(1000))
    assert min(spread.values()) > 150
    with pytest.raises(ValueError):
        ShardSpec(3, 3)
    p = plan(["a", "b", "c", "d"], ["r"], 2)
    assert sorted(w for ws in p.workers.values() for w in ws) == ["a", "b", "c", "d"]
    assert p.routers == {0: ("r",)}
    assert "shard 1" in "\n".join(p.lines())
