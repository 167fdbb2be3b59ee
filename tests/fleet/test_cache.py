"""PagedPrefixCache: matching, LRU eviction of unreferenced blocks, events, visibility."""

from fleet.cache import Cleared, PagedPrefixCache, Removed, Stored
from fleet.hashing import block_hash, chain_hashes


def test_chain_hashes_are_chained_deterministic_u64_and_full_blocks_only():
    toks = list(range(1, 40))
    hs = chain_hashes(toks, 16)
    assert len(hs) == 2  # 39 tokens: two full blocks, the partial tail has no hash
    assert hs == chain_hashes(toks[:32], 16) == chain_hashes([*toks, 7], 16)[:2]
    assert hs[0] == block_hash(None, toks[:16])
    assert hs[1] == block_hash(hs[0], toks[16:32])
    assert all(0 <= h < 2**64 for h in hs)
    # same block tokens under another parent hash to something else
    assert block_hash(hs[0], toks[:16]) != hs[0]
    assert chain_hashes([9, *toks[1:]], 16)[1] != hs[1]


def test_store_match_and_events_with_parent_and_tokens():
    c = PagedPrefixCache(num_gpu_blocks=10, block_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7]
    hit, ev = c.store("a", [11, 12, 13], toks)
    assert hit == 0
    assert ev == [Stored((11, 12, 13), None, (1, 2, 3, 4, 5, 6), 2, "GPU")]
    assert c.match([11, 12, 99]) == 2 and c.match([99, 11]) == 0
    c.release("a")
    # a second request extends the chain: only the new block is stored, parent = 13
    hit, ev = c.store("b", [11, 12, 13, 14], [1, 2, 3, 4, 5, 6, 8, 8])
    assert hit == 3
    assert ev == [Stored((14,), 13, (8, 8), 2, "GPU")]
    assert c.resident_blocks == 4


def test_last_token_rule_caps_hits_without_duplicating_blocks():
    c = PagedPrefixCache(10, 2)
    c.store("a", [1, 2])
    c.release("a")
    hit, ev = c.store("b", [1, 2], max_hit_blocks=(4 - 1) // 2)  # 4-token prompt, all cached
    assert hit == 1 and ev == [] and c.resident_blocks == 2


def test_lru_evicts_unreferenced_leaf_first_and_never_running_blocks():
    c = PagedPrefixCache(num_gpu_blocks=4, block_size=1)
    c.store("a", [1, 2])
    c.release("a")
    c.store("b", [3])  # b keeps running: block 3 is referenced
    _, ev = c.store("c", [4, 5, 6])  # needs 3 blocks, 1 free: evict 2 (leaf) then 1
    assert ev[:2] == [Removed((2,)), Removed((1,))]
    assert ev[2] == Stored((4, 5, 6), None, (), 1)
    assert 3 in c and c.resident_blocks == 4
    # everything is referenced now: a new request cannot evict, its blocks are not cached
    _, ev = c.store("d", [7])
    assert ev == [] and 7 not in c
    c.release("c")
    c.release("d")
    _, ev = c.store("e", [8])
    assert ev == [Removed((6,)), Stored((8,), None, (), 1)]


def test_lru_order_follows_last_use():
    c = PagedPrefixCache(3, 1)
    for rid, h in (("a", 1), ("b", 2), ("c", 3)):
        c.store(rid, [h])
        c.release(rid)
    c.store("hit", [1])  # touch 1: now 2 is the oldest
    c.release("hit")
    _, ev = c.store("n", [9])
    assert ev[0] == Removed((2,))


def test_blocks_visible_only_after_commit_and_shared_on_concurrent_compute():
    c = PagedPrefixCache(10, 2)
    _hit, ev = c.acquire("a", [1, 2], [1, 2, 3, 4])
    assert ev == [] and c.match([1, 2]) == 0  # in flight: not visible yet
    hit_b, _ = c.acquire("b", [1, 2, 3])  # runs alongside, computes the same blocks
    assert hit_b == 0
    assert c.commit("a") == [Stored((1, 2), None, (1, 2, 3, 4), 2)]
    assert c.match([1, 2, 3]) == 2
    # b's copy of 1, 2 is already resident: only 3 is new, and its parent is 2
    assert c.commit("b") == [Stored((3,), 2, (), 2)]
    assert c.resident_blocks == 3
    c.release("a")
    c.release("b")
    assert c.used_blocks == 0


def test_usage_counts_running_and_anonymous_blocks_and_reset_clears():
    c = PagedPrefixCache(10, 4)
    c.acquire("a", [1, 2], extra_blocks=3)
    assert c.used_blocks == 5 and c.usage == 0.5
    c.commit("a")
    assert c.used_blocks == 5
    assert c.reset() == [Cleared()]
    assert c.resident_blocks == 0 and c.used_blocks == 5  # the running request keeps its room
    c.release("a")
    assert c.used_blocks == 0
    _, ev = c.store("b", [1])
    assert ev == [Stored((1,), None, (), 4)]
