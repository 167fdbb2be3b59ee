"""Where the cache hits land, and what changed: the history behind hot branches and /api/v1/changes.

Every hit a record reports is kept for an hour as (time, leading blocks of its chain, hit
tokens, session key); a branch is resolved only when read, against the tree statistics of that
read, so a hit counts for the branch its chain belongs to in the current tree. New session keys
are kept the same way (time, segment, re-keyed?) so "what changed" can compare two windows.

Memory: an hour of hits at a busy cluster's record rate is a lot of events, so each is kept
small — its chain as 8 bytes a block (a tuple of Python ints costs ~40 B a block), and chains
that repeat (turns of one conversation, requests behind one system prompt) share one copy. At
most ``max_events`` hits are kept (``limits.hit_history``, default ``MAX_HISTORY_EVENTS``): ~0.1 KB
each plus their distinct chains (≤ 0.5 KB); past it the oldest go, and the history covers less
than the hour.

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from exporter.prefix_index import PrefixIndex, TreeStats

HISTORY_S = 3600.0  # how far back /api/v1/changes can look
MAX_HISTORY_EVENTS = 200_000
MAX_CHAIN_KEPT = 64  # leading blocks of a hit's chain kept: enough to find its branch (radix depth ≤ 2)
MAX_INTERNED = 65_536  # distinct chains remembered for sharing; past it the table starts afresh

Chain = bytes | tuple[int, ...]  # 8 bytes a block (native order), or ints when not all fit in 64 bits


def _packed(chain: Sequence[int]) -> Chain:
    try:
        return array("Q", chain).tobytes()
    except (OverflowError, TypeError):  # not a 64-bit hash: kept as it came (the index will not know it)
        return tuple(chain)


def _blocks(chain: Chain) -> Sequence[int]:
    return memoryview(chain).cast("Q") if isinstance(chain, bytes) else chain

BranchHits = dict[int, tuple[float, set[str]]]


def branch_label(block: int) -> str:
    """A branch as shown on /metrics: the first 8 hex digits of its first block's 64-bit hash."""
    return f"{block & 0xFFFFFFFFFFFFFFFF:016x}"[:8]


class Hotspots:
    """Hit and new-session history over the last hour."""

    def __init__(self, index: PrefixIndex, max_events: int = MAX_HISTORY_EVENTS) -> None:
        self.index = index
        self.hit_events: deque[tuple[float, Chain, float, str | None]] = deque(maxlen=max_events)
        self._interned: dict[Chain, Chain] = {}
        self.session_events: deque[tuple[float, str, bool]] = deque(maxlen=max_events)

    def hit(self, ts: float, chain: Sequence[int], hit_blocks: int, tokens: float, session: str | None) -> None:
        packed = _packed(chain[:min(hit_blocks, MAX_CHAIN_KEPT)])
        shared = self._interned.get(packed)
        if shared is None:
            if len(self._interned) >= MAX_INTERNED:
                self._interned.clear()  # chains still in the history stay alive through their events
            shared = self._interned[packed] = packed
        self.hit_events.append((ts, shared, tokens, session))

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
                b = self.index.branch_of(_blocks(chain), stats)
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
