"""The compiled index and the Python reference give identical observable results on random streams.

Streams follow a fixed random forest of block hashes (as real chained hashes do: a block's parent
is always the same block), with stored sub-chains under known, unheld or never-seen parents,
removals of held and unknown blocks, clears and restarts, three workers and several media. The
tree statistics — all kept at apply time by the compiled index, leaf depths included — are
compared with the reference's pass after every batch; streams under arbitrary parents (parent
cycles, orphans, splits and merges above long chains) too.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.core.index import prefix_index
from exporter.core.index.prefix_index import ReferencePrefixIndex, compute_stats
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored

compiled = pytest.importorskip("exporter.core.index._prefix_core")
CompiledPrefixIndex = compiled.CompiledPrefixIndex


@pytest.fixture(params=["walk", "halves"])  # a setting of the module, meant to last across a test's examples
def lookup_mode(request: pytest.FixtureRequest):
    """``longest_match`` block by block, or searching by halves wherever that is exact (every chain)."""
    previous = compiled.set_binary_from(1 if request.param == "halves" else 1 << 30)
    yield request.param
    compiled.set_binary_from(previous)


def open_blocks_hold(idx) -> None:
    """The compiled index's open blocks as kept at apply time are those counted anew, and every
    path fingerprint follows from its parent's."""
    if isinstance(idx, CompiledPrefixIndex):
        kept, counted = idx._open_blocks()
        assert kept == counted
        assert idx._fingerprints_hold()

UNIVERSE = 40
WORKERS = ("w0", "w1", "w2")
MEDIA = (None, "GPU", "CPU", "disk")
NEVER = 0xDEAD_BEEF_0000  # a parent hash no stream ever stores


def hash_of(i: int) -> int:
    """Spread the universe over 64 bits (some hashes above 2^63)."""
    return (i + 1) * 0x9E37_79B9_7F4A_7C15 & 0xFFFF_FFFF_FFFF_FFFF


@st.composite
def forests(draw: st.DrawFn) -> list[list[int]]:
    """The root path of every block of a random forest over the universe."""
    paths: list[list[int]] = []
    for i in range(UNIVERSE):
        up = draw(st.integers(-1, i - 1)) if i else -1
        paths.append([*(paths[up] if up >= 0 else []), hash_of(i)])
    return paths


@st.composite
def batches(draw: st.DrawFn, paths: list[list[int]]) -> tuple[str, list, bool]:
    worker = draw(st.sampled_from(WORKERS))
    events: list = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 19))
        medium = draw(st.sampled_from(MEDIA))
        if kind < 10:
            path = paths[draw(st.integers(0, UNIVERSE - 1))]
            i = draw(st.integers(0, len(path) - 1))
            j = draw(st.integers(i + 1, len(path)))
            parent = path[i - 1] if i else None
            if draw(st.integers(0, 9)) == 0:
                parent = NEVER  # an unknown parent: the run hangs off the root
            events.append(BlockStored(tuple(path[i:j]), parent, 16, medium=medium))
        elif kind < 18:
            n = draw(st.integers(1, 4))
            hs = [hash_of(draw(st.integers(0, UNIVERSE))) for _ in range(n)]  # UNIVERSE: never stored
            events.append(BlockRemoved(tuple(hs), medium=medium))
        else:
            events.append(AllBlocksCleared())
    restart = draw(st.integers(0, 24)) == 0
    return worker, events, restart


def observe(idx, paths: list[list[int]]) -> dict:
    hashes = [hash_of(i) for i in range(UNIVERSE + 1)]
    media = sorted(idx.media)
    out: dict = {
        "len": len(idx), "resident": idx.resident_by_worker(), "by_medium": idx.resident_by_medium(),
        "holders": [idx.holders(h) for h in hashes], "parent": [idx.parent(h) for h in hashes],
        "in": [h in idx for h in hashes],
        "media": idx.media,
        "holds": [idx.holds(w, h, m) for w in WORKERS for h in hashes for m in (None, *media)],
        "per_medium": [idx.resident_blocks(w, m) for w in WORKERS for m in (None, *media)],
        "hits": [idx.hit_tokens(h) for h in hashes],
        "blocks_of": [sorted(idx.blocks_of(w)) for w in WORKERS],
    }
    chains = [*paths[::3], hashes[:7], hashes[5:9]]
    out["match"] = [(m.blocks, m.per_worker, m.best_workers, [m.depth_on(w) for w in WORKERS],
                     [m.best_depth(set(WORKERS[:k])) for k in range(len(WORKERS) + 1)])
                    for m in map(idx.longest_match, chains)]
    s = idx.stats(keep_children_depth=3)
    out["stats"] = (s.blocks, s.nodes, s.root_fanout, dict(s.leaf_depths), dict(s.leaf_block_depths),
                    dict(s.fanouts), dict(s.replicas), set(s.branching),
                    {k: sorted(v) for k, v in s.children.items()}, {k: list(v) for k, v in s.runs.items()})
    out["branch_of"] = [idx.branch_of(c, s) for c in chains]
    return out


def payload(events: list, arrays: bool) -> bytes:
    """The events as a vLLM KV batch (array-encoded events as vLLM <= 0.23 sends them, else maps)."""
    out: list = []
    for ev in events:
        if type(ev) is BlockStored:
            out.append(["BlockStored", list(ev.hashes), ev.parent, [], ev.block_size, None, ev.medium] if arrays else
                       {"type": "BlockStored", "block_hashes": list(ev.hashes), "parent_block_hash": ev.parent,
                        "block_size": ev.block_size, "medium": ev.medium})
        elif type(ev) is BlockRemoved:
            out.append(["BlockRemoved", list(ev.hashes), ev.medium] if arrays else
                       {"type": "BlockRemoved", "block_hashes": list(ev.hashes), "medium": ev.medium})
        else:
            out.append(["AllBlocksCleared"] if arrays else {"type": "AllBlocksCleared"})
    return msgpack.packb([1.5, out, None])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_compiled_and_reference_agree_on_random_streams(data: st.DataObject, lookup_mode: str) -> None:
    paths = data.draw(forests())
    ref, comp, scanned = ReferencePrefixIndex(), CompiledPrefixIndex(), CompiledPrefixIndex()
    arrays = data.draw(st.booleans())
    for _ in range(data.draw(st.integers(1, 25))):
        worker, events, restart = data.draw(batches(paths))
        want = ref.apply(worker, events)
        assert comp.apply(worker, events) == want
        scan = compiled.scan_kv_batch(payload(events, arrays))  # the batch as the compiled reader reads it
        assert scan is not None and scanned.apply_scan(worker, scan) == want
        if restart:
            for idx in (ref, comp, scanned):
                idx.clear_worker(worker)
        chain = paths[data.draw(st.integers(0, UNIVERSE - 1))]
        m = ref.longest_match(chain)
        for idx in (ref, comp, scanned):
            idx.record_hits(chain, m.blocks, 16)
        assert observe(ref, paths) == observe(comp, paths) == observe(scanned, paths)
        open_blocks_hold(comp)
        open_blocks_hold(scanned)


def _pass_fields(s) -> tuple:
    return (s.version, s.blocks, s.nodes, s.root_fanout, dict(s.leaf_depths), dict(s.leaf_block_depths),
            dict(s.fanouts), dict(s.replicas), set(s.branching),
            {k: sorted(v) for k, v in s.children.items()}, {k: list(v) for k, v in s.runs.items()})


def _counters(s) -> tuple:
    """What the compiled index keeps at apply time."""
    return s.version, s.blocks, s.nodes, s.root_fanout, dict(s.fanouts), dict(s.replicas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_walk_in_steps_equals_the_reference_pass(data: st.DataObject) -> None:
    # The compiled reading settles the depth shifts ``apply`` left queued, a few blocks per step,
    # and copies everything at its last step (when none is queued): with or without batches,
    # restarts and freed entries reused between the steps, it is the reference's pass over the
    # tree at the last step.
    paths = data.draw(forests())
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    for _ in range(data.draw(st.integers(0, 10))):
        worker, events, _restart = data.draw(batches(paths))
        ref.apply(worker, events)
        comp.apply(worker, events)
    quiet = data.draw(st.booleans())
    walk = comp.stats_pass()
    step = data.draw(st.integers(1, 6))
    while not walk.step(step):
        if quiet:
            continue
        worker, events, restart = data.draw(batches(paths))
        ref.apply(worker, events)
        comp.apply(worker, events)
        if restart:
            ref.clear_worker(worker)
            comp.clear_worker(worker)
    ref.version = comp.version  # the reference counts clears as versions too; align the label only
    got, want = compute_stats(walk, 3), ref.stats(3)
    assert _pass_fields(got) == _pass_fields(want)
    assert _counters(comp.stats(3)) == _counters(want)


def test_a_kept_run_reads_the_live_tree_and_falls_back_to_its_first_block() -> None:
    idx = CompiledPrefixIndex()
    idx.apply("w0", [BlockStored((1, 2, 3), None, 16), BlockStored((4, 5), 1, 16), BlockStored((6,), 1, 16)])
    s = idx.stats(2)
    assert {k: list(v) for k, v in s.runs.items()} == {2: [2, 3], 4: [4, 5]} and s.run(6) == (6,)
    assert 2 in s.runs and 9 not in s.runs and "x" not in s.runs
    idx.apply("w0", [BlockRemoved((3,))])  # the run 2-3 is gone as it was
    assert list(s.run(2)) == [2] and list(s.run(4)) == [4, 5]


@pytest.mark.parametrize("cls", [ReferencePrefixIndex, CompiledPrefixIndex])
def test_match_accessors_agree_with_the_per_worker_depths(cls) -> None:
    idx = cls()
    idx.apply("w0", [BlockStored((1, 2, 3, 4), None, 16)])
    idx.apply("w1", [BlockStored((1, 2), None, 16)])
    idx.apply("w2", [BlockStored((1, 2, 3), None, 16)])
    idx.apply("w3", [BlockStored((7,), None, 16)])
    m = idx.longest_match([1, 2, 3, 4, 5])
    assert [m.depth_on(w) for w in ("w0", "w1", "w2", "w3", "nobody")] == [4, 2, 3, 0, 0]
    assert m.best_depth() == m.best_depth(()) == 4
    assert m.best_depth({"w0"}) == 3 and m.best_depth({"w0", "w2"}) == 2 and m.best_depth({"w0", "w1", "w2"}) == 0
    assert m.best_depth({"w1", "nobody"}) == 4
    assert idx.longest_match([9]).best_depth({"w0"}) == 0
    left = frozenset({"w2", "w5"})
    assert m.best_depth_besides("w0", left) == 2 and m.best_depth_besides("w1", left) == 4
    assert m.best_depth_besides("nobody", left) == 4 and m.best_depth_besides("w0") == 3
    # A worker that left the pool and reaches the index later is excluded with the same set.
    idx.apply("w5", [BlockStored((1, 2, 3, 4, 5), None, 16)])
    m = idx.longest_match([1, 2, 3, 4, 5])
    assert m.best_depth_besides("w0", left) == 2 and m.best_depth_besides("w0", frozenset({"w2"})) == 5


@pytest.mark.parametrize("cls", [ReferencePrefixIndex, CompiledPrefixIndex])
def test_a_tier_removal_leaves_the_other_tiers_alone(cls) -> None:
    idx = cls()
    idx.apply("w0", [BlockStored((1, 2, 3), None, 16, medium="GPU"), BlockStored((1, 2), None, 16, medium="CPU")])
    assert idx.resident_by_medium() == {"w0": {"GPU": 3, "CPU": 2}} and idx.resident_blocks("w0") == 3
    res = idx.apply("w0", [BlockRemoved((1, 2, 3), medium="CPU")])
    assert res.unknown_removals == 1  # 3 was never on the CPU tier
    assert idx.resident_by_medium() == {"w0": {"GPU": 3, "CPU": 0}}
    assert idx.holds("w0", 1) and idx.holds("w0", 1, "GPU") and not idx.holds("w0", 1, "CPU")
    assert idx.longest_match([1, 2, 3]).blocks == 3
    idx.apply("w0", [BlockRemoved((1,), medium=None)])  # no medium: the GPU pool
    assert 1 not in idx and idx.resident_blocks("w0", "GPU") == 2
    assert idx.stats().blocks == 2 and idx.stats().root_fanout == 1  # 2-3 hang off the departed 1


@pytest.mark.parametrize("cls", [ReferencePrefixIndex, CompiledPrefixIndex])
def test_a_block_on_two_tiers_is_one_replica_of_its_worker(cls) -> None:
    idx = cls()
    idx.apply("w0", [BlockStored((1,), None, 16, medium="GPU"), BlockStored((1,), None, 16, medium="CPU")])
    idx.apply("w1", [BlockStored((1,), None, 16, medium="disk")])
    assert idx.stats().replicas == {2: 1} and idx.holders(1) == ["w0", "w1"]
    idx.clear_worker("w0")
    assert idx.resident_by_medium()["w0"] == {"GPU": 0, "CPU": 0, "disk": 0} and idx.holders(1) == ["w1"]


@pytest.mark.parametrize("cls", [ReferencePrefixIndex, CompiledPrefixIndex])
def test_more_media_than_the_index_keeps_is_a_clear_error(cls) -> None:
    idx = cls()
    idx.apply("w0", [BlockStored((i,), None, 16, medium=f"m{i}") for i in range(8)])
    with pytest.raises(ValueError, match="more than 8 cache media"):
        idx.apply("w0", [BlockStored((9,), None, 16, medium="m9")])


def test_the_core_in_use_is_named() -> None:
    assert prefix_index.CORE in ("compiled", "reference")
    want = CompiledPrefixIndex if prefix_index.CORE == "compiled" else ReferencePrefixIndex
    assert prefix_index.PrefixIndex is want


def test_lookups_agree_with_many_workers_and_mixed_tiers() -> None:
    # 60 workers over a 6-block shared prefix with random gaps and tiers: the survivor
    # intersection takes every path (same holders, merge, binary search) against the reference.
    import random

    rng = random.Random(7)
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    prefix = [hash_of(i) for i in range(6)]
    for w in range(60):
        upto = rng.choice([1, 6, 6, 6, rng.randint(1, 6)])
        for idx in (ref, comp):
            idx.apply(f"w{w}", [BlockStored(tuple(prefix[:upto]), None, 16, medium=rng.choice(MEDIA))])
        if rng.random() < 0.2:  # a gap in the middle: the worker matches only up to it
            gap = (prefix[rng.randrange(6)],)
            for idx in (ref, comp):
                for m in MEDIA:
                    idx.apply(f"w{w}", [BlockRemoved(gap, medium=m)])
    for n in range(1, 7):
        for chain in (prefix[:n], [*prefix[:n], hash_of(99)], prefix[n - 1:]):
            r, c = ref.longest_match(chain), comp.longest_match(chain)
            assert (r.blocks, r.per_worker) == (c.blocks, c.per_worker)


def test_the_reference_can_be_forced_and_says_so() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PREFIXSCOPE_INDEX": "reference", "PYTHONPATH": str(repo)}
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from exporter.core.index import prefix_index as p; print(p.CORE, p.PrefixIndex.__name__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["reference", "ReferencePrefixIndex"], out.stderr
    assert out.stderr.count("prefix index: the Python reference implementation") == 1


def test_a_parent_cycle_gives_the_reference_statistics() -> None:
    # Colliding hashes can close a parent cycle: 1 leaves while 2 still names it, then comes back
    # under 2. Counters kept at apply time and the walk's cut of the cycle match the reference.
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    batches = [("w0", [BlockStored((1,), None, 16), BlockStored((2,), 1, 16)]),
               ("w0", [BlockRemoved((1,))]),
               ("w0", [BlockStored((1, 3), 2, 16), BlockStored((4,), 2, 16)]),
               ("w1", [BlockStored((5,), 1, 16)]),
               ("w0", [BlockRemoved((2,))])]
    for worker, events in batches:
        assert ref.apply(worker, events) == comp.apply(worker, events)
        ref.version = comp.version
        assert _pass_fields(comp.stats(3)) == _pass_fields(ref.stats(3))


def test_a_reading_settles_the_queued_depths_in_steps_then_reads_in_one() -> None:
    # ``apply`` leaves subtree shifts queued; a reading settles them, a bounded number per step
    # (here one block a step), then copies the counters and histograms; with nothing queued
    # the reading is one step, whatever changed since the last one.
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()

    def apply(worker, events):
        ref.apply(worker, events)
        comp.apply(worker, events)
        ref.version = comp.version

    apply("w0", [BlockStored(tuple(range(1, 30)), None, 16), BlockStored((40, 41), 5, 16)])
    for worker, events in [("w1", [BlockStored((1, 2, 3, 4, 5, 40), None, 16)]),
                           ("w0", [BlockStored((40, 41), 5, 16, medium="CPU"), BlockRemoved((40, 41), medium="GPU")]),
                           ("w1", [BlockRemoved((40,))]),
                           ("w0", [BlockRemoved((41,), medium="CPU")]),
                           ("w0", [BlockRemoved((3,))]),
                           ("w0", [BlockStored((50,), 1, 16)])]:
        apply(worker, events)
        walk = comp.stats_pass()
        steps = 1
        while not walk.step(1):
            steps += 1
        assert _pass_fields(compute_stats(walk, 3)) == _pass_fields(ref.stats(3))
        assert comp.stats_pass().step(1)
    assert steps > 1  # the split at block 1 shifted the 28 blocks below it


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_lookup_rule_holds_against_the_reference(data: st.DataObject, lookup_mode: str) -> None:
    # The rule ``CompiledPrefixIndex.longest_match`` relies on (survivors shrink as subsets, so a
    # worker's depth is that of the deepest group naming it; a block with byte-identical holder
    # entries keeps the survivors): many workers, holders with gaps (a block held without its
    # parent), equal holder sets on different tiers, and holder counts far apart (both binary-search
    # intersections) — every depth, best depth and exclusion against the reference.
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    n_workers = data.draw(st.sampled_from((3, 40, 200)))
    workers = [f"w{i}" for i in range(n_workers)]
    chain = [hash_of(i) for i in range(data.draw(st.integers(1, 10)))]
    for w in workers:
        upto = data.draw(st.integers(0, len(chain)))
        medium = data.draw(st.sampled_from(MEDIA))
        events: list = [BlockStored(tuple(chain[:upto]), None, 16, medium=medium)] if upto else []
        if upto and data.draw(st.integers(0, 3)) == 0:  # a gap: a later block held without this one
            events.append(BlockRemoved((chain[data.draw(st.integers(0, upto - 1))],), medium=medium))
        if data.draw(st.integers(0, 5)) == 0:  # the same blocks on a second tier
            events.append(BlockStored(tuple(chain[:upto]), None, 16, medium="CPU"))
        for idx in (ref, comp):
            idx.apply(w, events)
    probes = [chain, [*chain, hash_of(99)], chain[1:], chain[:1]]
    sample = [*data.draw(st.lists(st.sampled_from(workers), max_size=4)), "nobody"]
    for c in probes:
        r, m = ref.longest_match(c), comp.longest_match(c)
        assert (r.blocks, r.per_worker, r.best_workers) == (m.blocks, m.per_worker, m.best_workers)
        assert [r.depth_on(w) for w in workers] == [m.depth_on(w) for w in workers]
        for w in sample:
            assert r.best_depth({w}) == m.best_depth({w}) == max(
                (d for x, d in r.per_worker.items() if x != w), default=0)
        assert r.best_depth(set(sample)) == m.best_depth(set(sample))
        # the record path's form: the serving worker and a kept set of workers that left the pool
        left = frozenset(sample[1:])
        for w in (*sample, workers[0]):
            want = r.best_depth({w, *left})
            assert r.best_depth_besides(w, left) == want
            assert m.best_depth_besides(w, left) == m.best_depth_besides(w, left) == want  # kept ids reused
            assert m.best_depth_besides(w, set(left)) == want  # a plain set: its ids looked up each time


def test_events_longer_than_the_stack_buffer_apply_alike() -> None:
    # More hashes in one event than apply reads onto the stack: a heap buffer for that event.
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    chain = tuple(hash_of(i) for i in range(200))
    for idx in (ref, comp):
        idx.apply("w0", [BlockStored(chain, None, 16), BlockStored(chain[:70], None, 16, medium="CPU")])
        idx.apply("w1", [BlockStored(chain[:130], None, 16)])
        idx.apply("w0", [BlockRemoved(chain[100:180]), BlockRemoved(chain[:65], medium="CPU")])
    assert observe(ref, [list(chain)]) == observe(comp, [list(chain)])
    with pytest.raises(TypeError):
        comp.apply("w2", [BlockStored((*chain[:80], "x"), None, 16)])
    assert comp.resident_blocks("w2") == 0  # the bad event was read before any of it was applied


SMALL = 10  # a small universe: stored under arbitrary parents, blocks come back under their descendants


@st.composite
def tangled_batches(draw: st.DrawFn) -> tuple[str, list]:
    """Chains under any parent (never-seen, departed, a descendant: parent cycles), removals in
    the middle of the tree, clears."""
    worker = draw(st.sampled_from(WORKERS[:2]))
    events: list = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.integers(0, 11))
        medium = draw(st.sampled_from(MEDIA[:3]))
        if kind < 6:
            hs = draw(st.lists(st.integers(0, SMALL - 1), min_size=1, max_size=4, unique=True))
            parent = draw(st.one_of(st.none(), st.integers(0, SMALL)))
            events.append(BlockStored(tuple(map(hash_of, hs)), None if parent is None else hash_of(parent), 16,
                                      medium=medium))
        elif kind < 11:
            hs = draw(st.lists(st.integers(0, SMALL - 1), min_size=1, max_size=3))
            events.append(BlockRemoved(tuple(map(hash_of, hs)), medium=medium))
        else:
            events.append(AllBlocksCleared())
    return worker, events


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_depths_kept_at_apply_time_through_cycles_orphans_and_clears(data: st.DataObject, lookup_mode: str) -> None:
    # Parents are arbitrary here, so departed blocks come back under their own descendants
    # (parent cycles, cut above their smallest hash), blocks leave the middle of the tree
    # (orphans), a block's only child gets a sibling (a split) or loses it (a merge), and whole
    # workers are cleared; after a batch (or a few: shifts left queued across batches) the
    # depths kept at apply time are the reference's, and a rebuild of every depth from the
    # roots changes nothing.
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    rounds = data.draw(st.integers(1, 30))
    for i in range(rounds):
        worker, events = data.draw(tangled_batches())
        assert ref.apply(worker, events) == comp.apply(worker, events)
        if data.draw(st.integers(0, 15)) == 0:
            ref.clear_worker(worker)
            comp.clear_worker(worker)
        ref.version = comp.version
        if i < rounds - 1 and data.draw(st.integers(0, 2)) == 0:
            continue
        keep = data.draw(st.integers(0, 4))
        got = _pass_fields(comp.stats(keep))
        assert got == _pass_fields(ref.stats(keep))
        comp._rebuild_depths()
        assert _pass_fields(comp.stats(keep)) == got
        open_blocks_hold(comp)
        for chain in ([hash_of(x) for x in data.draw(st.lists(st.integers(0, SMALL), max_size=6))],):
            r, m = ref.longest_match(chain), comp.longest_match(chain)
            assert (r.blocks, r.per_worker) == (m.blocks, m.per_worker)


@st.composite
def spine_batches(draw: st.DrawFn, spine: list[int], side: list[int]) -> tuple[str, list]:
    """Stores and removals along one long chain with one-block branches off it: splits and merges
    above large subtrees, removals of its middle blocks and their return."""
    worker = draw(st.sampled_from(WORKERS))
    events: list = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 5))
        i = draw(st.integers(0, len(spine) - 1))
        if kind == 0:  # a one-block branch off the spine
            events.append(BlockStored((side[i],), spine[i], 16))
        elif kind == 1:  # part of the spine, under its parent
            j = draw(st.integers(i + 1, len(spine)))
            events.append(BlockStored(tuple(spine[i:j]), spine[i - 1] if i else None, 16))
        elif kind <= 3:
            events.append(BlockRemoved((draw(st.sampled_from((spine[i], side[i]))),)))
        elif kind == 4:
            events.append(BlockRemoved(tuple(spine[i:i + draw(st.integers(1, 5))])))
        else:
            events.append(BlockStored((side[i], spine[i]), spine[i - 1] if i else None, 16))  # a longer branch
    return worker, events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_subtree_shifts_above_a_long_chain_match_the_reference(data: st.DataObject) -> None:
    spine = [hash_of(i) for i in range(40)]
    side = [hash_of(100 + i) for i in range(40)]
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    for idx in (ref, comp):
        idx.apply("w0", [BlockStored(tuple(spine), None, 16)])
    for _ in range(data.draw(st.integers(1, 25))):
        worker, events = data.draw(spine_batches(spine, side))
        assert ref.apply(worker, events) == comp.apply(worker, events)
        ref.version = comp.version
        assert _pass_fields(comp.stats(4)) == _pass_fields(ref.stats(4))


def test_a_split_and_a_merge_above_a_subtree_shift_its_leaves() -> None:
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    chain = tuple(range(1, 21))
    for idx in (ref, comp):
        idx.apply("w0", [BlockStored(chain, None, 16), BlockStored((30, 31), 20, 16), BlockStored((40,), 20, 16)])
    assert comp.stats().leaf_depths == {2: 2} and comp.stats().leaf_block_depths == {22: 1, 21: 1}
    steps = [[BlockStored((50,), 3, 16)],  # a split at block 3: everything below gains an edge
             [BlockRemoved((50,))],  # the merge back
             [BlockRemoved((10,))],  # the middle leaves: 11.. hang off the root
             [BlockStored((10,), 9, 16)],  # and comes back above its orphans
             [BlockRemoved((20,))]]  # the branching block leaves: two root-level runs
    for events in steps:
        ref.apply("w0", events)
        comp.apply("w0", events)
        ref.version = comp.version
        assert _pass_fields(comp.stats(3)) == _pass_fields(ref.stats(3))
    assert comp.stats().leaf_depths == {1: 3}  # 1..19, 30-31 and 40, each a root-level run


def test_depths_past_the_packed_range_match_the_reference() -> None:
    # A comb: a spine of 4,200 blocks with a tooth under each, so the deepest leaf is 4,200 radix
    # edges deep, past the 4,095 the compiled index packs per block (deeper depths are kept aside).
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    spine = [hash_of(i) for i in range(4200)]
    teeth = [hash_of(10_000 + i) for i in range(4200)]
    batches = [[BlockStored(tuple(spine), None, 16)],
               [BlockStored((t,), s, 16) for s, t in zip(spine, teeth, strict=True)],
               [BlockRemoved((teeth[7],))],  # a merge near the top: the rest loses an edge
               [BlockStored((teeth[7],), spine[7], 16)],  # and gains it back
               [BlockRemoved((spine[4100],))],  # the bottom orphaned
               [BlockRemoved(tuple(teeth[:50]))]]
    for events in batches:
        ref.apply("w0", events)
        comp.apply("w0", events)
        ref.version = comp.version
        assert _pass_fields(comp.stats(2)) == _pass_fields(ref.stats(2))
        deepest = max(comp.stats().leaf_depths)
        assert deepest > 4095 if events is not batches[0] and events is not batches[-1] else deepest < 4095
    comp.clear_worker("w1")  # nothing of w1: no rebuild
    comp._rebuild_depths()
    assert _pass_fields(comp.stats(2)) == _pass_fields(ref.stats(2))


@st.composite
def long_chain_batches(draw: st.DrawFn, chain: list[int], side: list[int], workers: list[str]) -> tuple[str, list]:
    """What breaks the order a binary search over a chain relies on, and what restores it: prefixes
    of one long chain, runs of it under a parent the worker lacks (or no parent at all), evictions
    in its middle (the blocks below stay held) and their return, branches off it (a block with
    more children than a holder change counts through becomes wide), clears."""
    worker = draw(st.sampled_from(workers))
    events: list = []
    n = len(chain)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 9))
        i = draw(st.integers(0, n - 1))
        if kind <= 2:  # a prefix, or its continuation under its parent
            j = draw(st.integers(i + 1, n))
            events.append(BlockStored(tuple(chain[i:j]), chain[i - 1] if i else None, 16,
                                      medium=draw(st.sampled_from(MEDIA[:3]))))
        elif kind == 3:  # a run of the chain with no parent: it hangs off the root
            events.append(BlockStored(tuple(chain[i:draw(st.integers(i + 1, n))]), None, 16))
        elif kind <= 5:  # an eviction in the middle
            events.append(BlockRemoved(tuple(chain[i:i + draw(st.integers(1, 3))]),
                                       medium=draw(st.sampled_from(MEDIA[:3]))))
        elif kind == 6:  # branches off the chain (many of them at one block: a wide block)
            k = draw(st.integers(1, 90))
            events.append(BlockStored((side[i],), chain[i], 16))
            events += [BlockStored((hash_of(5000 + 97 * i + x),), chain[i], 16) for x in range(k)]
        elif kind == 7:  # the branches go
            events.append(BlockRemoved((side[i], *(hash_of(5000 + 97 * i + x) for x in range(90)))))
        elif kind == 8:  # evicted from the tail up, as engines evict
            events.append(BlockRemoved(tuple(reversed(chain[i:]))))
        else:
            events.append(AllBlocksCleared())
    return worker, events


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_long_chain_searched_by_halves_matches_the_walk(data: st.DataObject) -> None:
    # Holdings that stop being prefix-closed (middle evictions, runs under parents the worker
    # lacks or hanging off the root) and that become closed again: after every batch the
    # compiled lookup — by halves where the open blocks and fingerprints allow it, block by
    # block elsewhere — gives the reference's per-worker depths, best depths and exclusions.
    chain = [hash_of(i) for i in range(data.draw(st.sampled_from((40, 130))))]
    side = [hash_of(1000 + i) for i in range(len(chain))]
    workers = [f"w{i}" for i in range(data.draw(st.sampled_from((3, 12))))]
    ref, comp = ReferencePrefixIndex(), CompiledPrefixIndex()
    previous = compiled.set_binary_from(1)
    try:
        for w in workers:
            upto = data.draw(st.integers(0, len(chain)))
            for idx in (ref, comp):
                idx.apply(w, [BlockStored(tuple(chain[:upto]), None, 16)] if upto else [])
        for _ in range(data.draw(st.integers(1, 12))):
            worker, events = data.draw(long_chain_batches(chain, side, workers))
            assert ref.apply(worker, events) == comp.apply(worker, events)
            open_blocks_hold(comp)
            for c in (chain, chain[: len(chain) // 2], [*chain[:20], side[19]], chain[5:]):
                r, m = ref.longest_match(c), comp.longest_match(c)
                assert (r.blocks, r.per_worker) == (m.blocks, m.per_worker)
                assert [r.depth_on(w) for w in workers] == [m.depth_on(w) for w in workers]
                left = frozenset(workers[1:3])
                for w in workers[:4]:
                    assert m.best_depth_besides(w, left) == r.best_depth_besides(w, left)
    finally:
        compiled.set_binary_from(previous)
