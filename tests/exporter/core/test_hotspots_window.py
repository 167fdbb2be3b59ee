"""Hot branches from the incremental window: the same ranking as a scan of the history, at a
cost that does not grow with the history's length."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest

from exporter.core.hotspots import BranchResolver, Hotspots
from exporter.core.index.prefix_index import PrefixIndex, TreeStats, compute_stats, pass_in_slices
from exporter.core.index.prefix_index_ref import ReferencePrefixIndex
from exporter.model import BlockRemoved, BlockStored, KvEvent


class CountingIndex:
    """An index stand-in: a set of blocks, resolved by the reference ``branch_of``, every
    membership test counted."""

    def __init__(self, blocks: set[int]) -> None:
        self.blocks = blocks
        self.version = 0
        self.lookups = 0

    def __contains__(self, block: object) -> bool:
        self.lookups += 1
        return block in self.blocks

    def branch_of(self, blocks: Sequence[int], stats: TreeStats) -> int | None:
        return ReferencePrefixIndex.branch_of(self, blocks, stats)  # type: ignore[arg-type]

    def change(self, rng: random.Random) -> None:
        self.blocks ^= {rng.randrange(12)}
        self.version += 1


def _scan(hs: Hotspots, k: int, start: float, end: float, stats: TreeStats) -> list[tuple[int, float]]:
    return [(b, tok) for b, tok, _s in hs.hot_branches(k, start, end, stats)]


def test_incremental_window_ranks_as_the_history_scan() -> None:
    rng = random.Random(3)
    index = CountingIndex(set(range(10)))
    hs = Hotspots(index, max_events=300)  # type: ignore[arg-type]
    trees = [TreeStats(version=v, branching=frozenset(rng.sample(range(12), 3))) for v in range(4)]
    stats = trees[0]
    now, window = 1000.0, 60.0
    for step in range(400):
        for _ in range(rng.randrange(6)):
            # mostly current, some late (already outside the window), some from the near future
            ts = now + rng.choice((0.0, -rng.random() * 90, rng.random() * 5))
            chain = [rng.randrange(12) for _ in range(rng.randrange(1, 6))]
            hs.hit(ts, chain, rng.randrange(1, 6), float(rng.randrange(1, 64)), None)
        if step % 7 == 0:
            index.change(rng)
        if step % 23 == 0:
            stats = rng.choice(trees)
        now += rng.random() * 2
        if step % 5 == 0:
            hs.expire(now)
        assert hs.hot_branch_tokens(10, now - window, now, stats) == _scan(hs, 10, now - window, now, stats)


def _afresh(hs: Hotspots, stats: TreeStats) -> dict[int, float]:
    """The window's tokens per branch summed from scratch, chain by chain in the window's order."""
    assert hs._window is not None
    resolver = BranchResolver(hs.index)
    resolver.refresh(stats)
    return resolver._summed(hs._window.tokens, stats.branching)[0]


def _top(totals: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


@pytest.mark.parametrize("fractions", [False, True])
def test_kept_sums_read_as_summed_afresh(fractions: bool) -> None:
    """The per-branch sums kept between reads (only what moved applied) equal the window summed
    afresh, whatever the reads' spacing: several hits and expiries between two reads, a stretch
    nobody reads (what moved is no longer kept), the index and the statistics changing. Tokens
    that are not whole numbers make every read sum afresh, in the window's order, while they are
    in the window."""
    rng = random.Random(11 + fractions)
    index = CountingIndex(set(range(10)))
    hs = Hotspots(index, max_events=400)  # type: ignore[arg-type]
    trees = [TreeStats(version=v, branching=frozenset(rng.sample(range(12), 3))) for v in range(4)]
    stats = trees[0]
    now, window = 1000.0, 60.0
    for step in range(600):
        # ~2,400 hits nobody reads, late (inside the window already read): more moves than it holds
        unread = 300 <= step < 340
        for _ in range(rng.randrange(120 if unread else 8)):
            ts = now - rng.random() * 50 if unread else now + rng.choice((0.0, -rng.random() * 90, rng.random() * 5))
            chain = [rng.randrange(60), *(rng.randrange(12) for _ in range(rng.randrange(5)))]  # branches come and go
            tokens = float(rng.randrange(0, 64))
            if fractions and 100 <= step < 200 and rng.random() < 0.05:
                tokens += rng.choice((0.1, 0.25, 1e-9))
            hs.hit(ts, chain, rng.randrange(1, 6), tokens, None)
        if step % 67 == 0:
            index.change(rng)
        if step % 97 == 0:
            stats = rng.choice(trees)
        if unread:
            continue
        now += rng.random() * 2
        if step % 5 == 0:
            hs.expire(now)
        if rng.random() < 0.6:
            continue
        got = hs.hot_branch_tokens(10, now - window, now, stats)
        kept = hs._resolver._kept
        assert kept is not None and kept[2] == _afresh(hs, stats)  # every branch's sum, no branch left over
        assert got == _top(kept[2], 10)
        if not fractions:
            assert got == _scan(hs, 10, now - window, now, stats)
    # Whole tokens only in the window again: a read applies what moved to the sums it keeps.
    kept = hs._resolver._kept
    hs.hit(now, [1, 2], 2, 16.0, None)
    assert hs.hot_branch_tokens(10, now - window, now, stats) == _top(_afresh(hs, stats), 10)
    assert kept is not None and hs._resolver._kept is not None and hs._resolver._kept[2] is kept[2]


@pytest.mark.parametrize("make", [PrefixIndex, ReferencePrefixIndex])
def test_resolution_matches_branch_of_on_a_real_index(make: type) -> None:
    """Chains behind a shared prompt, some branching off it, some whose path lost a block."""
    rng = random.Random(5)
    index = make()
    prompt = (1, 2, 3, 4)
    events: list[KvEvent] = [BlockStored(prompt, None, 16)]
    for b in range(6):
        events.append(BlockStored((100 + b, 200 + b), 4, 16))
    events.append(BlockStored((300, 301), 2, 16))  # a second branch point at block 2
    index.apply("w0", events)
    hs = Hotspots(index)
    chains = [[*prompt, 100 + rng.randrange(8), 200 + rng.randrange(8)][:rng.randrange(1, 7)] for _ in range(60)]
    chains += [[1, 2, 300, 301]] * 3 + [[9, 1, 2]]
    for i, chain in enumerate(chains):
        hs.hit(10.0 + i, chain, len(chain), 16.0 * (i % 5 + 1), None)
    for step in range(3):
        stats = compute_stats(pass_in_slices(index, threading.Lock())[0])
        assert stats.branching  # the test needs branch points
        assert hs.hot_branch_tokens(20, 0.0, 100.0, stats) == [(b, t) for b, t, _s in
                                                               hs.hot_branches(20, 0.0, 100.0, stats)]
        # The index changes between reads, without a new statistics pass: one removal on the path.
        index.apply("w0", [BlockRemoved((3 - step,))])


def test_read_cost_does_not_grow_with_the_history() -> None:
    """A full hour-long history of old hits costs a read nothing: only the window's distinct
    chains are walked, their shared path is looked up once per index version, and a read with
    nothing changed does no work at all."""
    stats = TreeStats(version=1, branching=frozenset({3}))

    def lookups(old_events: int) -> tuple[int, int, int]:
        index = CountingIndex(set(range(1, 10_000)))
        hs = Hotspots(index, max_events=50_000)  # type: ignore[arg-type]
        for i in range(old_events):  # within the hour, before the window
            hs.hit(100.0 + i * 1e-3, [1, 2, 3, 100 + i % 500], 4, 16.0, f"s{i}")
        for i in range(200):  # the window: 20 distinct chains behind one shared path 1, 2, 3
            hs.hit(1000.0 + i, [1, 2, 3, 4 + i % 20], 4, 16.0, f"s{i}")
        first = hs.hot_branch_tokens(10, 900.0, 1200.0, stats)
        assert [b for b, _t in first] == list(range(4, 14)) and first[0][1] == 160.0
        reads = [index.lookups]
        hs.hot_branch_tokens(10, 900.0, 1200.0, stats)
        reads.append(index.lookups)
        index.version += 1
        hs.hot_branch_tokens(10, 901.0, 1201.0, stats)
        reads.append(index.lookups)
        return reads[0], reads[1] - reads[0], reads[2] - reads[1]

    assert lookups(40_000) == lookups(0) == (2, 0, 2)


def test_an_unread_window_does_not_keep_a_second_history() -> None:
    """Hits keep arriving while nobody reads hot branches: the window lets go of them, and the
    next read is still exact."""
    stats = TreeStats(version=1, branching=frozenset({3}))
    index = CountingIndex(set(range(1, 100)))
    hs = Hotspots(index, max_events=5000)  # type: ignore[arg-type]
    hs.hot_branch_tokens(10, 0.0, 1.0, stats)
    for i in range(20_000):
        hs.hit(2.0 + i / 10, [1, 2, 3, 4 + i % 7], 4, 16.0, None)
        window = hs._window
        assert window is None or len(window.pending) <= 2500 + 1024
    now = 2.0 + 20_000 / 10
    assert hs.hot_branch_tokens(10, now - 60, now, stats) == _scan(hs, 10, now - 60, now, stats)
