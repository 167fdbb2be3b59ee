"""Routing policies as pure functions: each one's routing property, measured on many keys."""

from __future__ import annotations

import random

from fleet.policies import (
    Candidate,
    HashRing,
    PolicyParams,
    pick_hash_mod,
    pick_prefix_tree,
    pick_round_robin,
    pick_topology_aware,
    preferred_classes,
    stable_hash,
)
from fleet.topology import load_topology

KEYS = [f"session-{i}" for i in range(20000)]


def _cands(names, matches=None, loads=None, capacity=48):
    matches, loads = matches or {}, loads or {}
    return [Candidate(n, loads.get(n, 0), capacity, matches.get(n, 0)) for n in names]


def test_stable_hash_is_deterministic_across_processes() -> None:
    # a fixed value: Python's own hash() is salted per process and would reshuffle on restart
    assert stable_hash("session-1") == stable_hash("session-1")
    assert stable_hash("a") != stable_hash("b")
    assert 0 <= stable_hash("x") < 2**64


def test_hash_mod_reshuffles_about_n_minus_1_over_n_on_scale_out() -> None:
    before = _cands([f"w{i}" for i in range(7)])
    after = _cands([f"w{i}" for i in range(8)])
    moved = sum(pick_hash_mod(k, before)[0] != pick_hash_mod(k, after)[0] for k in KEYS) / len(KEYS)
    # a key stays only if h % 7 == h % 8, i.e. for 7 residues of 56: moved = 1 - 7/56 = 7/8
    assert abs(moved - 7 / 8) < 0.01


def test_consistent_hash_moves_about_1_over_n_on_scale_out() -> None:
    before = HashRing([f"w{i}" for i in range(7)])
    after = HashRing([f"w{i}" for i in range(8)])
    moved = [k for k in KEYS if before.lookup(k) != after.lookup(k)]
    assert abs(len(moved) / len(KEYS) - 1 / 8) < 0.03
    assert all(after.lookup(k) == "w7" for k in moved)  # only the new worker takes keys


def test_consistent_hash_spreads_keys_evenly() -> None:
    ring = HashRing([f"w{i}" for i in range(8)])
    counts: dict[str, int] = {}
    for k in KEYS:
        counts[ring.lookup(k)] = counts.get(ring.lookup(k), 0) + 1
    assert max(counts.values()) / min(counts.values()) < 1.5


def test_round_robin_cycles() -> None:
    c = _cands(["a", "b", "c"])
    assert [pick_round_robin(c, i)[0] for i in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_prefix_tree_prefers_the_longest_match_until_load_outweighs_it() -> None:
    names = ["w0", "w1", "w2"]
    # 300 blocks x 16 tokens = 4800 tokens of reuse on w1; one in-flight request costs 1024
    assert pick_prefix_tree(_cands(names, {"w1": 300, "w2": 10}), 16) == ("w1", "prefix_hit")
    assert pick_prefix_tree(_cands(names, {"w1": 300}, {"w1": 5}), 16)[0] == "w0"
    # nothing cached anywhere: least loaded
    assert pick_prefix_tree(_cands(names, {}, {"w0": 3, "w1": 1, "w2": 2}), 16) == ("w1", "least_loaded")


def test_prefix_tree_keeps_a_shared_prefix_group_together() -> None:
    """Sessions sharing a prefix go where it is cached, even though others are idle."""
    names = [f"w{i}" for i in range(8)]
    placed = []
    loads: dict[str, int] = {}
    matches = {"w5": 250}  # the group's system prompt is cached on w5 only
    rng = random.Random(1)
    for _ in range(40):
        w, _d = pick_prefix_tree(_cands(names, matches, loads), 16)
        placed.append(w)
        # requests finish before the next arrives most of the time: load stays 0 or 1
        loads = {w: rng.choice([0, 0, 0, 1])}
    assert set(placed) == {"w5"}


def test_prefix_tree_spills_when_the_holder_is_far_busier() -> None:
    names = ["w0", "w1"]
    params = PolicyParams(load_cost_tokens=0.0, balance_abs=8)  # pure match, but bounded imbalance
    assert pick_prefix_tree(_cands(names, {"w1": 300}, {"w1": 8}), 16, params)[0] == "w1"
    assert pick_prefix_tree(_cands(names, {"w1": 300}, {"w1": 9}), 16, params)[0] == "w0"


def test_topology_aware_picks_the_domain_holding_the_longest_prefix() -> None:
    topo = load_topology()
    names = [w.name for w in topo.workers if not w.warm_pool]  # w1 w2 w3 w5 w6 w7
    # the prefix lives on w3 (node-a/nvl1); w2 shares that NVLink domain and is idle, w3 busy
    cands = _cands(names, {"w3": 200, "w6": 50}, {"w3": 2})
    w, decision = pick_topology_aware(cands, 4000, 200, topo)
    assert decision == "prefix_hit"
    assert topo.domain_of(w) == "node-a/nvl1"


def test_topology_aware_sends_long_prompts_to_the_fast_prefill_class() -> None:
    topo = load_topology()
    names = [w.name for w in topo.workers if not w.warm_pool]
    loads = {"w1": 5, "w2": 5, "w3": 5}  # the H100 workers are busier than the A100 ones
    long_doc = pick_topology_aware(_cands(names, {}, loads), 20000, 200, topo)[0]
    short_chat = pick_topology_aware(_cands(names, {}, loads), 1000, 200, topo)[0]
    assert topo.worker(long_doc).gpu_class == "H100"
    assert topo.worker(short_chat).gpu_class == "A100"
    assert preferred_classes(1000, 4000, topo, names) == {"H100"}  # long generation: fastest decode
