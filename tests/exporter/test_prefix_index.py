"""The prefix index and tree statistics against hand-computed values."""

from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored
from exporter.prefix_index import PrefixIndex


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
    assert sorted(s.leaf_depths) == [2, 2, 2]
    assert sorted(s.leaf_block_depths) == [3, 3, 3]
    assert s.fanouts == [3]
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
    assert s.root_fanout == 1 and s.blocks == 2 and s.leaf_block_depths == [2]


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
    assert sorted(s.leaf_depths) == [2, 2]
    assert sorted(s.leaf_block_depths) == [5, 6]
    assert s.nodes == 3
