"""Hot branches from the incremental window: the same ranking as a scan of the history, at a
cost that does not grow with the history's length."""

from __future__ import annotations

import random
from collections.abc import Sequence

from exporter.hotspots import Hotspots
from exporter.prefix_index import TreeStats

STATS = TreeStats(version=1)


class CountingIndex:
    """An index stand-in: a chain's branch is its first block modulo a divisor that changes with
    the version (so a changed tree re-resolves), and every resolution is counted."""

    def __init__(self) -> None:
        self.version = 0
        self.calls = 0

    def branch_of(self, blocks: Sequence[int], stats: TreeStats) -> int | None:
        self.calls += 1
        if blocks[0] % 11 == 0:
            return None
        return blocks[0] % (7 + self.version % 3)


def _scan(hs: Hotspots, k: int, start: float, end: float) -> list[tuple[int, float]]:
    return [(b, tok) for b, tok, _s in hs.hot_branches(k, start, end, STATS)]


def test_incremental_window_ranks_as_the_history_scan() -> None:
    rng = random.Random(3)
    index = CountingIndex()
    hs = Hotspots(index, max_events=300)  # type: ignore[arg-type]
    now, window = 1000.0, 60.0
    for step in range(400):
        for _ in range(rng.randrange(6)):
            # mostly current, some late (already outside the window), some from the near future
            ts = now + rng.choice((0.0, -rng.random() * 90, rng.random() * 5))
            chain = [rng.randrange(40), rng.randrange(3)]
            hs.hit(ts, chain, rng.randrange(1, 3), float(rng.randrange(1, 64)), None)
        if step % 37 == 0:
            index.version += 1
        now += rng.random() * 2
        if step % 5 == 0:
            hs.expire(now)
        assert hs.hot_branch_tokens(10, now - window, now, STATS) == _scan(hs, 10, now - window, now)


def test_read_cost_does_not_grow_with_the_history() -> None:
    """A full hour-long history of old hits costs a read nothing: only the window's distinct chains
    are resolved, once per tree version, and not again while nothing changed."""

    def reads(old_events: int) -> tuple[int, int, int]:
        index = CountingIndex()
        hs = Hotspots(index, max_events=50_000)  # type: ignore[arg-type]
        for i in range(old_events):  # within the hour, before the window
            hs.hit(100.0 + i * 1e-3, [i % 500, 1], 2, 16.0, f"s{i}")
        for i in range(200):  # the window: 20 distinct chains
            hs.hit(1000.0 + i, [i % 20, 1], 2, 16.0, f"s{i}")
        hs.hot_branch_tokens(10, 900.0, 1200.0, STATS)
        first = index.calls
        hs.hot_branch_tokens(10, 900.0, 1200.0, STATS)
        again = index.calls - first
        index.version += 1
        hs.hot_branch_tokens(10, 901.0, 1201.0, STATS)
        return first, again, index.calls - first - again

    # The first read builds the window from the history once; later reads never scan it.
    assert reads(40_000)[1:] == reads(0)[1:] == (0, 20)
