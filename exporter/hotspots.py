"""Where the cache hits land, and what changed: the history behind hot branches and /api/v1/changes.

Every hit a record reports is kept for an hour as (time, leading blocks of its chain, hit
tokens, session key); a branch is resolved only when read, against the tree statistics of that
read, so a hit counts for the branch its chain belongs to in the current tree. New session keys
are kept the same way (time, segment, re-keyed?) so "what changed" can compare two windows.

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from exporter.prefix_index import PrefixIndex, TreeStats

HISTORY_S = 3600.0  # how far back /api/v1/changes can look
MAX_HISTORY_EVENTS = 200_000
MAX_CHAIN_KEPT = 64  # leading blocks of a hit's chain kept: enough to find its branch (radix depth ≤ 2)

BranchHits = dict[int, tuple[float, set[str]]]


def branch_label(block: int) -> str:
    """A branch as shown on /metrics: the first 8 hex digits of its first block's 64-bit hash."""
    return f"{block & 0xFFFFFFFFFFFFFFFF:016x}"[:8]


class Hotspots:
    """Hit and new-session history over the last hour."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.hit_events: deque[tuple[float, tuple[int, ...], float, str | None]] = deque(maxlen=MAX_HISTORY_EVENTS)
        self.session_events: deque[tuple[float, str, bool]] = deque(maxlen=MAX_HISTORY_EVENTS)

    def hit(self, ts: float, chain: Sequence[int], hit_blocks: int, tokens: float, session: str | None) -> None:
        self.hit_events.append((ts, tuple(chain[:min(hit_blocks, MAX_CHAIN_KEPT)]), tokens, session))

    def new_session(self, ts: float, segment: str, rekeyed: bool) -> None:
        self.session_events.append((ts, segment, rekeyed))

    def expire(self, now: float) -> None:
        cutoff = now - HISTORY_S
        for events in (self.hit_events, self.session_events):
            while events and events[0][0] <= cutoff:
                events.popleft()

    def branch_hits(self, start: float, end: float, stats: TreeStats) -> BranchHits:
        """Hit tokens and sessions per branch for hits with start < ts ≤ end."""
        out: BranchHits = {}
        for ts, chain, tokens, session in self.hit_events:
            if start < ts <= end:
                b = self.index.branch_of(chain, stats)
                if b is None:
                    continue
                tok, sess = out.get(b, (0.0, set()))
                if session:
                    sess.add(session)
                out[b] = (tok + tokens, sess)
        return out

    def hot_branches(self, k: int, start: float, end: float, stats: TreeStats) -> list[tuple[int, float, int]]:
        """Top-k branches of hits in (start, end]: (first block, hit tokens, sessions)."""
        hits = self.branch_hits(start, end, stats)
        ranked = sorted(hits.items(), key=lambda kv: (-kv[1][0], kv[0]))[:k]
        return [(b, tok, len(sess)) for b, (tok, sess) in ranked]
