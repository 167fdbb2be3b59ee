"""The compiled eviction tracker and the Python reference give identical results on random streams.

Streams run on a small universe of block hashes (some above 2^63), so the same blocks are stored,
evicted and stored again: stored chains under known, sampled or unknown parents, removals of held
and never-stored blocks, repeated hashes, clears, restarts, request-record hits, time steps inside
and beyond the window (and the odd step back), three workers and every medium spelling, and far
samples sized from capacities that arrive and change mid-stream. Memory is small so that the
bounded tables drop their oldest entries, and sampling keeps 1, 2 or 4 in 4.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.core.index.eviction import EvictionTracker
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored

compiled = pytest.importorskip("exporter.core.index._prefix_core")
CompiledEvictionTracker = compiled.CompiledEvictionTracker

WORKERS = ("w0", "w1", "w2")
GPU_MEDIA = (None, "GPU", "gpu")
OTHER_MEDIA = ("CPU", "disk")
UNIVERSE = tuple(i if i % 3 else (1 << 63) + i for i in range(24))  # hash 0 and 2^64-1 included
UNIVERSE += (0xFFFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF_FFFF_FFF0)
WINDOW = 10.0

hashes = st.sampled_from(UNIVERSE)


@st.composite
def events(draw: st.DrawFn, media: tuple = (*GPU_MEDIA, *OTHER_MEDIA)) -> object:
    kind = draw(st.integers(0, 19))
    medium = draw(st.sampled_from(media))
    if kind < 9:
        run = tuple(draw(st.lists(hashes, min_size=0, max_size=6)))
        parent = draw(st.one_of(st.none(), hashes, st.just(0xDEAD_BEEF_0000)))
        return BlockStored(run, parent, 16, medium=medium)
    if kind < 18:
        return BlockRemoved(tuple(draw(st.lists(hashes, min_size=0, max_size=4))), medium=medium)
    return AllBlocksCleared()


@st.composite
def streams(draw: st.DrawFn, media: tuple = (*GPU_MEDIA, *OTHER_MEDIA)) -> list[tuple]:
    """(worker, events, ts, restart, hits) per batch; time mostly rises, sometimes past the window."""
    ts, out = 100.0, []
    for _ in range(draw(st.integers(1, 30))):
        ts += draw(st.sampled_from((0.0, 0.5, 3.0, WINDOW, WINDOW + 0.25, 40.0, -1.0)))
        worker = draw(st.sampled_from(WORKERS))
        batch = draw(st.lists(events(media), max_size=6))
        restart = draw(st.integers(0, 19)) == 0
        hit = draw(st.lists(hashes, max_size=4)) if draw(st.booleans()) else []
        out.append((worker, batch, ts, restart, hit))
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


def _trackers(draw: st.DrawFn) -> tuple[EvictionTracker, object]:
    memory = draw(st.sampled_from((1, 2, 3, 5, 8, 200)))
    sample_every = draw(st.sampled_from((1, 2, 4)))
    return (EvictionTracker(WINDOW, memory, sample_every),
            CompiledEvictionTracker(WINDOW, memory, sample_every))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_compiled_and_reference_agree_on_random_streams(data: st.DataObject) -> None:
    ref, comp = _trackers(data.draw)
    scanned = CompiledEvictionTracker(ref.window_s, ref.memory, ref.sample_every)  # fed the compiled reader's scans
    arrays = data.draw(st.booleans())
    for worker, batch, ts, restart, hit in data.draw(streams()):
        if data.draw(st.integers(0, 4)) == 0:  # the worker's capacity arrives or changes: its far sample
            capacity = data.draw(st.sampled_from((None, 0, 1, 7, 50, 400)))
            for t in (ref, comp, scanned):
                t.size_for(worker, capacity)
            assert ref.far_every(worker) == comp.far_every(worker) == scanned.far_every(worker)
        want = ref.apply(worker, batch, ts)
        assert comp.apply(worker, batch, ts) == want
        scan = compiled.scan_kv_batch(payload(batch, arrays))
        assert scan is not None and scanned.apply_scan(worker, scan, ts) == want
        if hit:
            for t in (ref, comp, scanned):
                t.hits(worker, hit)
        if restart:
            for t in (ref, comp, scanned):
                t.clear_worker(worker)
        assert [ref.tracked(w) for w in WORKERS] == [comp.tracked(w) for w in WORKERS] \
            == [scanned.tracked(w) for w in WORKERS]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_other_tiers_never_touch_the_gpu_view(data: st.DataObject) -> None:
    # The same GPU stream with CPU/disk events mixed in reads the same, except that the batch
    # says another medium was seen.
    gpu_only = data.draw(streams(GPU_MEDIA))
    memory = data.draw(st.sampled_from((1, 3, 200)))
    sample_every = data.draw(st.sampled_from((1, 4)))
    for make in (EvictionTracker, CompiledEvictionTracker):
        plain, mixed = make(WINDOW, memory, sample_every), make(WINDOW, memory, sample_every)
        for worker, batch, ts, _restart, _hit in gpu_only:
            extra = data.draw(st.lists(events(OTHER_MEDIA).filter(lambda e: not isinstance(e, AllBlocksCleared)),
                                       max_size=3))
            where = data.draw(st.integers(0, len(batch)))
            got = mixed.apply(worker, [*batch[:where], *extra, *batch[where:]], ts)
            want = plain.apply(worker, batch, ts)
            assert got.other_media == bool(extra)
            got.other_media = want.other_media
            assert got == want
            assert mixed.tracked(worker) == plain.tracked(worker)


def test_the_compiled_tracker_is_bounded_and_reads_the_known_cases() -> None:
    tracker = CompiledEvictionTracker(window_s=300.0, memory=32, sample_every=1)
    for i in range(10_000):
        tracker.apply("w0", [BlockStored((i,), None, 16), BlockRemoved((i,))], float(i) / 100)
    recent, live = tracker.tracked("w0")
    assert recent <= 32 and live <= 32
    tracker = CompiledEvictionTracker(window_s=300.0, sample_every=1)
    tracker.apply("w0", [BlockStored((1, 2), None, 16), BlockStored((3,), None, 16), BlockStored((4,), None, 16)], 0.0)
    tracker.apply("w0", [BlockStored((5,), 1, 16)], 1.0)
    tracker.hits("w0", [3, -1, "x", 1 << 70])  # what is no block hash matches nothing
    out = tracker.apply("w0", [BlockRemoved((1,)), BlockRemoved((2,)), BlockRemoved((3,)), BlockRemoved((4,))], 10.0)
    assert sorted(out.ages) == [(10.0, False), (10.0, False), (10.0, True), (10.0, True)]
    out = tracker.apply("w0", [BlockStored((1, 2, 9), None, 16)], 20.0)
    assert (out.stored, out.restored, out.evicted) == (3, 2, 0)


def test_the_compiled_tracker_checks_its_settings() -> None:
    for bad in ({"memory": 0}, {"memory": 1 << 30}, {"sample_every": 3}, {"sample_every": 0}):
        with pytest.raises(ValueError):
            CompiledEvictionTracker(300.0, **bad)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_one_pass_of_index_and_tracker_equals_the_two_applies(data: st.DataObject) -> None:
    # ``apply_kv`` applies a scanned batch to the index and the eviction tracker in one pass: the
    # same results and the same state as the two ``apply_scan`` calls, whatever the stream.
    ref, _ = _trackers(data.draw)
    one_tracker = CompiledEvictionTracker(ref.window_s, ref.memory, ref.sample_every)
    two_tracker = CompiledEvictionTracker(ref.window_s, ref.memory, ref.sample_every)
    one_index, two_index = compiled.CompiledPrefixIndex(), compiled.CompiledPrefixIndex()
    arrays = data.draw(st.booleans())
    for worker, batch, ts, restart, hit in data.draw(streams()):
        scan = compiled.scan_kv_batch(payload(batch, arrays))
        assert scan is not None
        got_index, got_evictions = one_index.apply_kv(worker, scan, one_tracker, ts)
        assert got_index == two_index.apply_scan(worker, scan)
        assert got_evictions == two_tracker.apply_scan(worker, scan, ts)
        if hit:
            one_tracker.hits(worker, hit)
            two_tracker.hits(worker, hit)
        if restart:
            for part in (one_tracker, two_tracker, one_index, two_index):
                part.clear_worker(worker)
        assert [one_tracker.tracked(w) for w in WORKERS] == [two_tracker.tracked(w) for w in WORKERS]
        assert one_index.resident_by_worker() == two_index.resident_by_worker()
        assert len(one_index) == len(two_index)
        assert all(one_index.longest_match((h,)).blocks == two_index.longest_match((h,)).blocks for h in UNIVERSE)


@pytest.mark.parametrize("memory", [300, 4096])
def test_compiled_and_reference_agree_while_tables_grow_fill_and_drop(memory: int) -> None:
    # Thousands of distinct hashes, so the compiled tables double from their first allocation up
    # to ``memory``, then drop their oldest entries one per entry added, while blocks are stored
    # again from within and beyond the exact ring, re-evicted, hit and cleared: long probe runs in
    # the hash index, and every kind of slot removal (lookup hits, drops of the oldest, re-stores).
    import random

    rng = random.Random(memory)
    universe = [rng.getrandbits(64) for _ in range(3 * memory)]
    ref, comp = EvictionTracker(WINDOW * 100, memory, 4), CompiledEvictionTracker(WINDOW * 100, memory, 4)
    held: dict[str, list[int]] = {w: [] for w in WORKERS}
    ts = 0.0
    for step in range(1_500):
        worker = WORKERS[step % 3]
        ts += rng.choice((0.0, 0.5, 1.0, 2.0))
        batch: list = []
        start = rng.randrange(len(universe) - 64)
        run = tuple(universe[start:start + rng.randint(1, 64)])
        batch.append(BlockStored(run, universe[start - 1] if start and rng.random() < 0.8 else None, 16))
        held[worker] += run
        if len(held[worker]) > memory // 2:  # evict the oldest, with a few never-stored hashes
            gone, held[worker] = held[worker][:64], held[worker][64:]
            batch.append(BlockRemoved(tuple(gone) + tuple(rng.sample(universe, 3))))
        if step % 400 == 399:
            batch.append(AllBlocksCleared())
            held[worker] = []
        assert comp.apply(worker, batch, ts) == ref.apply(worker, batch, ts), step
        if rng.random() < 0.1:
            hit = rng.sample(held[worker], min(5, len(held[worker])))
            ref.hits(worker, hit)
            comp.hits(worker, hit)
        assert comp.tracked(worker) == ref.tracked(worker)


@pytest.mark.parametrize("memory", [7, 300])
def test_long_streams_agree_while_the_rings_double_compact_and_drop(memory: int) -> None:
    # The compiled rings of evictions are logs that double, compact when they reach their end and
    # drop their oldest entry at ``memory``: thousands of batches over a universe much larger
    # than ``memory`` go through each of those many times (the random streams above are short).
    import random

    rng = random.Random(memory)
    universe = [rng.getrandbits(64) for _ in range(4 * memory + 50)]
    ref, comp = EvictionTracker(WINDOW, memory, 2), CompiledEvictionTracker(WINDOW, memory, 2)
    ts = 0.0
    for step in range(6_000):
        worker = WORKERS[rng.randrange(2)]
        ts += rng.choice((0.0, 0.001, 0.01, 0.01, 0.2)) if step % 997 else WINDOW * 0.6
        batch: list[object] = []
        for _ in range(rng.randint(1, 3)):
            k = rng.randrange(10)
            run = tuple(rng.sample(universe, rng.randint(1, 12)))
            if k < 5:
                batch.append(BlockStored(run, rng.choice((None, *run[:1])), 16))
            elif k < 9:
                batch.append(BlockRemoved(run))
            elif step % 50 == 0:
                batch.append(AllBlocksCleared())
        if step % 400 == 0:  # a capacity arrives or changes: the far sample is sized again
            capacity = rng.choice((None, 64, 5_000))
            for t in (ref, comp):
                t.size_for(worker, capacity)
        assert comp.apply(worker, batch, ts) == ref.apply(worker, batch, ts)
        assert [comp.tracked(w) for w in WORKERS] == [ref.tracked(w) for w in WORKERS]
