"""The prefix index and tree statistics against hand-computed values."""

from array import array

from exporter.core.index.prefix_index import PrefixIndex
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored


def stored(hashes, parent=None):
    return BlockStored(tuple(hashes), parent, 16)


def small_tree() -> PrefixIndex:
    # w0: 1-2-3 and 2-4 ; w1: 1-2-5  → shared run [1,2] branching into 3, 4, 5
    idx = PrefixIndex()
    idx.apply("w0", [stored([1, 2, 3]), stored([4], parent=2)])
    idx.apply("w1", [stored([1, 2, 5])])
    return idx


def test_tree_statistics_by_hand():
    s = small_tree().stats()
    assert s.blocks == 5
    assert s.root_fanout == 1
    assert s.nodes == 4  # [1,2], [3], [4], [5]
    assert sorted(s.leaf_depths.elements()) == [2, 2, 2]
    assert sorted(s.leaf_block_depths.elements()) == [3, 3, 3]
    assert s.fanouts == {3: 1}
    assert s.replicas == {1: 3, 2: 2}


def test_stored_is_idempotent_and_removal_of_unknown_is_counted():
    idx = small_tree()
    again = idx.apply("w0", [stored([1, 2, 3])])
    assert idx.resident_blocks("w0") == 4 and again.unknown_parent == 0
    res = idx.apply("w0", [BlockRemoved((3, 99))])
    assert res.unknown_removals == 1
    assert idx.resident_blocks("w0") == 3
    assert 3 not in idx.stats().leaf_depths or idx.stats().blocks == 4


def test_unknown_parent_kept_as_root_level_orphan():
    idx = PrefixIndex()
    res = idx.apply("w0", [stored([7, 8], parent=42)])
    assert res.unknown_parent == 1
    s = idx.stats()
    assert s.root_fanout == 1 and s.blocks == 2 and s.leaf_block_depths == {2: 1}


def test_clear_affects_only_that_worker_and_blocks_leave_when_unheld():
    idx = small_tree()
    idx.apply("w1", [AllBlocksCleared()])
    assert idx.resident_blocks("w1") == 0
    assert idx.resident_blocks("w0") == 4
    assert idx.stats().blocks == 4  # block 5 was only on w1
    assert idx.holders(1) == ["w0"]


def test_longest_match_per_worker():
    m = small_tree().longest_match([1, 2, 3, 9])
    assert m.blocks == 3
    assert m.per_worker == {"w0": 3, "w1": 2}
    assert m.best_workers == ["w0"]
    assert PrefixIndex().longest_match([1]).blocks == 0


def test_radix_depth_counts_branches_not_blocks():
    # 10-11-12-13 then branches 20 / 30-31 ; depth in edges: 2, in blocks 5 and 6
    idx = PrefixIndex()
    idx.apply("w0", [stored([10, 11, 12, 13, 20]), stored([30, 31], parent=13)])
    s = idx.stats()
    assert sorted(s.leaf_depths.elements()) == [2, 2]
    assert sorted(s.leaf_block_depths.elements()) == [5, 6]
    assert s.nodes == 3


# ---- batched apply: the same result as applying every hash in order --------------------------

class OrderedModel:
    """The index's semantics written as the plain ordered walk: one event, one hash at a time."""

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.held: dict[int, set[str]] = {}
        self.resident: dict[str, int] = {}

    def apply(self, worker, events):
        out = {"stored": 0, "removed": 0, "cleared": 0, "unknown_parent": 0, "unknown_removals": 0}
        self.resident.setdefault(worker, 0)
        for ev in events:
            if isinstance(ev, BlockStored):
                out["stored"] += len(ev.hashes)
                prev = ev.parent
                if prev is not None and worker not in self.held.get(prev, ()):
                    out["unknown_parent"] += 1
                    if prev not in self.held:
                        prev = None
                for h in ev.hashes:
                    if worker not in self.held.get(h, ()):
                        if h not in self.held:
                            self.parent[h] = prev
                        self.held.setdefault(h, set()).add(worker)
                        self.resident[worker] += 1
                    prev = h
            elif isinstance(ev, BlockRemoved):
                out["removed"] += len(ev.hashes)
                for h in ev.hashes:
                    if worker not in self.held.get(h, ()):
                        out["unknown_removals"] += 1
                        continue
                    self._drop(h, worker)
            else:
                out["cleared"] += 1
                for h in [h for h, ws in self.held.items() if worker in ws]:
                    self._drop(h, worker)
        return out

    def _drop(self, h, worker):
        self.held[h].discard(worker)
        self.resident[worker] -= 1
        if not self.held[h]:
            del self.held[h], self.parent[h]


def test_batched_apply_matches_the_ordered_walk():
    import random

    for seed in range(300):
        rng = random.Random(seed)
        universe = rng.choice([8, 30, 500])  # small universes repeat hashes inside one event
        idx, model = PrefixIndex(), OrderedModel()
        for _ in range(30):
            worker = f"w{rng.randrange(3)}"
            events = []
            for _ in range(rng.randint(0, 8)):
                r = rng.random()
                if r < 0.45:  # short runs are walked, runs of 8+ go through the bulk path
                    n = rng.choice([1, 3, 8, 12])
                    events.append(stored([rng.randrange(universe) for _ in range(n)],
                                         rng.choice([None, rng.randrange(universe)])))
                elif r < 0.96:
                    events.append(BlockRemoved(tuple(rng.randrange(universe) for _ in range(rng.randint(1, 3)))))
                else:
                    events.append(AllBlocksCleared())
            res = idx.apply(worker, events)
            want = model.apply(worker, events)
            assert {k: getattr(res, k) for k in want} == want, seed
            assert res.stored_events + res.removed_events + res.cleared == len(events)
        assert len(idx) == len(model.held), seed
        for h in range(universe):
            assert sorted(idx.holders(h)) == sorted(model.held.get(h, ())), (seed, h)
            assert idx.parent(h) == model.parent.get(h), (seed, h)
        assert idx.resident_by_worker() == model.resident, seed


def test_one_batch_of_removals_by_hand():
    idx = PrefixIndex()
    idx.apply("w0", [stored(range(1, 11))])  # 1..10: a bulk-stored run
    idx.apply("w1", [stored([1, 2])])
    idx.record_hits([1, 2, 3], 3, 16)
    # vLLM sends one event per evicted block; 2 twice (the second is unknown), 99 never stored.
    res = idx.apply("w0", [BlockRemoved((h,)) for h in (3, 2, 2, 99, 1)])
    assert (res.removed, res.removed_events, res.unknown_removals) == (5, 5, 2)
    assert idx.resident_by_worker() == {"w0": 7, "w1": 2}
    assert idx.holders(1) == ["w1"] and idx.holders(3) == []
    assert idx.hit_tokens(1) == 16 and idx.hit_tokens(3) == 0  # hits leave with the block
    assert idx.parent(4) == 3 and len(idx) == 9  # 4's parent left: it stays, a root-level orphan later


def test_long_run_naming_a_block_twice_is_applied_in_order():
    idx = PrefixIndex()
    res = idx.apply("w0", [stored([5, 6, 7, 8, 6, 9, 10, 11, 12])])  # 6 repeats: collision
    assert idx.resident_blocks("w0") == 8 and res.stored == 9
    assert idx.parent(6) == 5 and idx.parent(9) == 6  # the first occurrence keeps its parent


# ---- statistics walked run by run --------------------------------------------------------------

def test_kept_runs_are_the_top_of_the_tree():
    # 10-11-12-13 then branches 20 / 30-31 (edge 2), and 31 branches into 40 / 50-51 (edge 3)
    idx = PrefixIndex()
    idx.apply("w0", [stored([10, 11, 12, 13, 20]), stored([30, 31, 40], parent=13), stored([50, 51], parent=31)])
    top = idx.stats(keep_children_depth=1)
    assert top.children == {-1: [10]} and top.run(10) == array("Q", [10, 11, 12, 13])
    assert top.run(30) == (30,)  # beyond the kept top: just the block
    two = idx.stats(keep_children_depth=2)
    assert sorted(two.children[13]) == [20, 30] and 31 not in two.children
    assert list(two.run(30)) == [30, 31] and two.run(20) == (20,)
    three = idx.stats(keep_children_depth=3)
    assert sorted(three.children[31]) == [40, 50] and list(three.run(50)) == [50, 51]
    assert sorted(three.leaf_depths.elements()) == [2, 3, 3] and sorted(three.leaf_block_depths.elements()) == [5, 7, 8]
    assert idx.stats().children == {} and idx.stats().runs == {}


def test_depths_when_a_parent_is_stored_after_its_child_and_orphans():
    idx = PrefixIndex()
    idx.apply("w0", [stored([1, 2, 3])])
    idx.apply("w0", [BlockRemoved((1,))])  # 2-3 now hang off a departed parent: a root-level run
    s = idx.stats(keep_children_depth=2)
    assert (s.root_fanout, s.nodes, s.leaf_block_depths) == (1, 1, {2: 1})
    assert s.children == {-1: [2]} and list(s.run(2)) == [2, 3]
    idx.apply("w0", [stored([1])])  # 1 is back, inserted after its child: 2 still names it
    s = idx.stats(keep_children_depth=2)
    assert (s.root_fanout, s.nodes, s.leaf_block_depths) == (1, 1, {3: 1})
    assert list(s.run(1)) == [1, 2, 3]


def test_a_parent_cycle_from_colliding_hashes_ends():
    idx = PrefixIndex()
    idx.apply("w0", [stored([1, 2]), stored([7], parent=1)])
    idx.apply("w0", [BlockRemoved((1,))])
    idx.apply("w0", [stored([1], parent=2)])  # 1 -> 2 -> 1, with 7 hanging off 1
    s = idx.stats(keep_children_depth=4)
    assert s.blocks == 3 and s.branching == frozenset({1})


def test_statistics_over_more_blocks_than_one_chunk_of_the_pass():
    # 2,200 runs of 32 blocks under one shared block: 70,401 blocks, beyond one 65,536-entry chunk.
    idx = PrefixIndex()
    idx.apply("w0", [stored([7])])
    idx.apply("w0", [stored(range(1000 + 32 * i, 1032 + 32 * i), parent=7) for i in range(2200)])
    idx.apply("w1", [stored(range(1000, 1032), parent=7)])  # one run on a second worker too
    s = idx.stats(keep_children_depth=2)
    assert (s.blocks, s.root_fanout, s.nodes, s.fanouts) == (70_401, 1, 2201, {2200: 1})
    assert s.leaf_depths == {2: 2200} and s.leaf_block_depths == {33: 2200}
    assert s.replicas == {1: 70_401 - 32, 2: 32}
    assert len(s.children[7]) == 2200 and list(s.run(1000)) == list(range(1000, 1032))
