"""The compiled index grows without a stall: no ``apply`` moves entries in proportion to the index.

Its entry arrays grow inside address space reserved for them (past 65,536 entries no entry moves
again), and a doubled hash table is filled from the old one a few slots per entry added and a
slice per ``apply``. These tests count the entries each ``apply`` moves (the index reports them)
rather than timing anything, and hold the index to the reference while tables drain.
"""

from __future__ import annotations

import random

import pytest

from exporter.core.index.prefix_index import ReferencePrefixIndex
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored

compiled = pytest.importorskip("exporter.core.index._prefix_core")
CompiledPrefixIndex = compiled.CompiledPrefixIndex

RESERVE_AT = 1 << 16  # entries past which the entry arrays move into their reservation (one copy)
DRAIN_PER_ADD = 4  # old-table slots moved per entry added
DRAIN_SLICE = 256  # old-table slots moved per apply besides


def _moved(index) -> int:
    return index._growth()["moved"]


def test_each_apply_moves_entries_in_proportion_to_its_own_work_not_the_index() -> None:
    index = CompiledPrefixIndex()
    rng = random.Random(7)
    next_hash, held = 1, []
    slots_seen, copies, most = set(), [], 0
    while len(index) < 400_000:
        events: list = []
        for _ in range(rng.randint(1, 4)):  # stores of 64-block chains, and some removals
            chain = tuple(range(next_hash, next_hash + 64))
            next_hash += 64
            events.append(BlockStored(chain, None, 16))
            held.append(chain)
        if rng.random() < 0.3 and len(held) > 8:
            events.append(BlockRemoved(held.pop(rng.randrange(len(held)))))
        before, capacity = _moved(index), index._growth()["capacity"]
        added = len(index)
        index.apply(f"w{rng.randrange(8)}", events)
        added = max(len(index) - added, 0) + 64 * len(events)
        moved = _moved(index) - before
        growth = index._growth()
        slots_seen.add(growth["slots"])
        if growth["capacity"] != capacity and moved > DRAIN_PER_ADD * added + DRAIN_SLICE:
            copies.append(capacity)  # the entry arrays grew by copying: small ones, up to the reservation
        else:
            assert moved <= DRAIN_PER_ADD * added + DRAIN_SLICE, (len(index), moved, added)
        most = max(most, moved)
    growth = index._growth()
    assert len(slots_seen) >= 6, "the table doubled several times on the way"
    assert growth["reserved"] > growth["capacity"], "the entry arrays live in reserved address space"
    assert copies and max(copies) < RESERVE_AT, copies
    assert most < RESERVE_AT < len(index) / 6
    assert growth["most_moved_by_one_apply"] == most
    assert growth["moved"] >= len(index), "every entry still went through each table it outgrew"


def test_lookups_and_removals_during_a_drain_agree_with_the_reference() -> None:
    rng = random.Random(11)
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    universe = [rng.getrandbits(64) for _ in range(120_000)]
    workers = ("w0", "w1", "w2")
    drained_mid_check, slots_seen = 0, set()
    for step in range(5_000):
        w = workers[step % 3]
        events: list = []
        start = rng.randrange(len(universe) - 64)
        if rng.random() < 0.75:
            n = rng.randint(32, 64)
            parent = universe[start - 1] if start and rng.random() < 0.7 else None
            events.append(BlockStored(tuple(universe[start:start + n]), parent, 16))
        if rng.random() < 0.3:
            events.append(BlockRemoved(tuple(rng.sample(universe, rng.randint(1, 40)))))
        if step in (700, 2_600):  # a worker restarts: a clear mid-stream
            events.append(AllBlocksCleared())
        assert comp.apply(w, events) == ref.apply(w, events)
        slots_seen.add(comp._growth()["slots"])
        if step % 40 == 0 or comp._growth()["draining"]:
            drained_mid_check += comp._growth()["draining"]
            probe = rng.sample(universe, 200)
            assert len(comp) == len(ref)
            assert comp.resident_by_worker() == ref.resident_by_worker()
            assert [h in comp for h in probe] == [h in ref for h in probe]
            assert [comp.holders(h) for h in probe] == [ref.holders(h) for h in probe]
            assert [comp.parent(h) for h in probe] == [ref.parent(h) for h in probe]
            chain = tuple(universe[start:start + 64])
            assert comp.longest_match(chain).per_worker == ref.longest_match(chain).per_worker
    assert drained_mid_check > 0, "some checks ran while a table was draining"
    growth = comp._growth()
    assert len(slots_seen) >= 6 and growth["reserved"] > growth["capacity"], growth  # both kinds of growth ran
    got, want = comp.stats(), ref.stats()
    assert (got.blocks, got.nodes, got.root_fanout, dict(got.leaf_depths), dict(got.replicas)) == \
        (want.blocks, want.nodes, want.root_fanout, dict(want.leaf_depths), dict(want.replicas))


def _unmix(m: int) -> int:
    """The block hash whose mixed value (the index's table hash, a bijection) is ``m``."""
    mask = (1 << 64) - 1
    x = m
    x ^= (x >> 31) ^ (x >> 62)
    x = (x * pow(0x94D049BB133111EB, -1, 1 << 64)) & mask
    x ^= (x >> 27) ^ (x >> 54)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & mask
    x ^= (x >> 30) ^ (x >> 60)
    return x


def test_long_probe_runs_shift_back_exactly_on_removal() -> None:
    # Hashes whose home slots all fall in the first 16 of the table (for every table size), so
    # their probe runs are hundreds of slots long: entries sit far past their home, further than a
    # slot can say (its distance saturates), and each removal's backward shift moves many of them,
    # in a table that doubles and drains on the way.
    rng = random.Random(5)
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    crowded = [_unmix((rng.getrandbits(44) << 20) | rng.randrange(16)) for _ in range(2_500)]
    spread = [rng.getrandbits(64) for _ in range(2_500)]  # the rest of the table, so runs cross them
    held: list[int] = []
    holding: set[int] = set()
    slots_seen, drained_while_removing = set(), 0
    for step in range(4_000):
        events: list = []
        if held and rng.random() < 0.35:
            gone = rng.sample(held, min(len(held), rng.randint(1, 8)))
            holding.difference_update(gone)
            held = [h for h in held if h in holding]
            events.append(BlockRemoved(tuple(gone)))
            drained_while_removing += comp._growth()["draining"]
        else:
            pool = crowded if rng.random() < 0.7 else spread
            new = [h for h in rng.sample(pool, 6) if h not in holding]
            held += new
            holding.update(new)
            events += [BlockStored((h,), None, 16) for h in new]
        assert comp.apply("w0", events) == ref.apply("w0", events), step
        slots_seen.add(comp._growth()["slots"])
        if step % 50 == 0:
            assert len(comp) == len(ref)
            assert all(comp.longest_match((h,)).blocks == ref.longest_match((h,)).blocks for h in crowded[:400])
    assert len(slots_seen) >= 2 and drained_while_removing, (slots_seen, drained_while_removing)
    assert len(comp) == len(ref) == len(held)
    assert all(comp.longest_match((h,)).blocks == 1 for h in held)
    assert all(comp.longest_match((h,)).blocks == 0 for h in crowded + spread if h not in holding)
