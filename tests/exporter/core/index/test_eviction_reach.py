"""Thrash beyond the exact ring of recent evictions: the sampled ring reaches further back.

Run on the reference and, when the extension is built, on the compiled tracker."""

from __future__ import annotations

import pytest

from exporter.core.index.eviction import EvictionTracker
from exporter.model import BlockRemoved, BlockStored

try:
    from exporter.core.index._prefix_core import CompiledEvictionTracker
except ImportError:  # the extension is not built: the reference alone
    IMPLEMENTATIONS = [EvictionTracker]
else:
    IMPLEMENTATIONS = [EvictionTracker, CompiledEvictionTracker]

pytestmark = pytest.mark.parametrize("Tracker", IMPLEMENTATIONS, ids=lambda c: c.__name__)


def _cycle(tracker: EvictionTracker, blocks: range, rounds: int) -> tuple[int, int]:
    """Store every block, evict it, and store it again a round later: (stored, restored) of the
    last round. Block ``i`` is the hash ``i``, so one in ``sample_every`` is sampled."""
    stored = restored = 0
    t = 0.0
    for r in range(rounds):
        for i in blocks:
            t += 0.001
            out = tracker.apply("w0", [BlockStored((i,), None, 16), BlockRemoved((i,))], t)
            if r == rounds - 1:
                stored, restored = stored + out.stored, restored + out.restored
    return stored, restored


def test_blocks_stored_again_within_the_exact_ring_count_one_by_one(Tracker: type) -> None:
    tracker = Tracker(window_s=300.0, memory=64, sample_every=16)
    assert _cycle(tracker, range(50), 3) == (50, 50)


def test_blocks_stored_again_beyond_the_exact_ring_are_counted_from_the_sample(Tracker: type) -> None:
    # 512 evictions between a block's eviction and its return: past the exact ring of 64, within
    # the sampled ring's 64 × 16; each of the 32 sampled blocks stands for 16
    tracker = Tracker(window_s=300.0, memory=64, sample_every=16)
    assert _cycle(tracker, range(512), 3) == (512, 512)
    recent, live = tracker.tracked("w0")
    assert recent <= 64 and live <= 64


def test_the_sample_reaches_no_further_than_its_ring_nor_the_window(Tracker: type) -> None:
    far = Tracker(window_s=300.0, memory=64, sample_every=16)
    assert _cycle(far, range(64 * 16 * 2), 2)[1] == 0  # 2048 evictions back: forgotten
    short = Tracker(window_s=0.1, memory=64, sample_every=16)
    assert _cycle(short, range(512), 2)[1] == 0  # 0.5 s back with a 0.1 s window: not thrash
