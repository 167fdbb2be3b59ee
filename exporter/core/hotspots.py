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

Hot branches on /metrics (``hot_branch_tokens``) read only the current window, and not by
scanning the history: hits are summed per distinct chain as they enter the window
(``WindowTokens``) and taken out again when they leave it (by age, or when the history drops
them). Each chain is resolved to its branch by ``BranchResolver``: where its branch point lies
once per statistics pass, whether the path to it is in the index once per distinct path and
index change. The per-branch sums are kept between reads: a read applies the hits that entered
or left the window since the last one, and sums the window's distinct chains again only after
new statistics or a path that came into or left the index. So a read costs a few dictionary
look-ups per hit that moved (per distinct chain of the window after such a change) plus a top-k
of the branches, and nothing while neither the window nor the tree changed; it never depends on
how many events the hour-long history holds. The window costs ~0.2 KB per event in it and its
distinct chains' sums; if nobody reads it for long, it is dropped and rebuilt from the history
at the next read. ``branch_hits``/``hot_branches`` (the API, with
session counts, over any interval) still scan the history.

Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Mapping, Sequence, Set
from itertools import islice
from operator import neg

from exporter.core.index.prefix_index import PrefixIndex, TreeStats

HISTORY_S = 3600.0  # how far back /api/v1/changes can look
MAX_HISTORY_EVENTS = 200_000
MAX_CHAIN_KEPT = 64  # leading blocks of a hit's chain kept: enough to find its branch (radix depth ≤ 2)
MAX_INTERNED = 65_536  # distinct chains remembered for sharing; past it the table starts afresh
MAX_SAVED_HITS = 20_000  # hit events a state file keeps (the newest): a few MB at most
MAX_SAVED_CHAINS = 4_096  # distinct chains among them, each ≤ MAX_CHAIN_KEPT blocks
MAX_SAVED_SESSIONS = 20_000

Chain = bytes | tuple[int, ...]  # 8 bytes a block (native order), or ints when not all fit in 64 bits


def _packed(chain: Sequence[int]) -> Chain:
    try:
        return array("Q", chain).tobytes()
    except (OverflowError, TypeError):  # not a 64-bit hash: kept as it came (the index will not know it)
        return tuple(chain)


def _blocks(chain: Chain) -> Sequence[int]:
    return memoryview(chain).cast("Q") if isinstance(chain, bytes) else chain

BranchHits = dict[int, tuple[float, set[str]]]
HitEvent = tuple[float, Chain, float, str | None]


class WindowTokens:
    """Hit tokens per distinct chain over a sliding window (start, end], kept incrementally.

    Every event has a sequence number; the history deque holds exactly the events numbered
    ``first_seq`` .. ``next_seq - 1`` (both expiry and the deque's cap drop from the left), so
    an event the history drops is found by its number and taken out of the sums. Events
    counted are also on a heap by time, and leave when the window's start passes them; events
    from the future (after the window's end) wait on a second heap.
    """

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.tokens: dict[Chain, float] = {}
        self.hits: dict[Chain, int] = {}  # events counted per chain (a chain leaves at 0: sums restart exact)
        self.counted: dict[int, tuple[float, Chain, float]] = {}  # seq -> (ts, chain, tokens)
        self.leaving: list[tuple[float, int]] = []  # (ts, seq) of counted events
        self.pending: list[tuple[float, int, Chain, float]] = []  # events after the window's end
        self.changes = 0  # bumped whenever the sums change
        # What changed since the last read (``take_moved``): (chain, tokens, chains) — tokens added
        # (negative: taken out) and +1 / -1 when the chain enters / leaves the window. None: more
        # moved than the window holds (nobody read it for long), and the next read starts afresh.
        self.moved: list[tuple[Chain, float, int]] | None = []
        self.uneven = 0  # counted events whose tokens are not a whole number ≥ 0 (sums depend on order)

    def add(self, seq: int, ts: float, chain: Chain, tokens: float) -> None:
        if ts <= self.start:
            return
        if ts > self.end:
            heapq.heappush(self.pending, (ts, seq, chain, tokens))
            return
        self.counted[seq] = (ts, chain, tokens)
        heapq.heappush(self.leaving, (ts, seq))
        n = self.hits.get(chain, 0)
        self.hits[chain] = n + 1
        self.tokens[chain] = self.tokens.get(chain, 0.0) + tokens
        self.changes += 1
        if not (tokens >= 0.0 and tokens % 1.0 == 0.0):
            self.uneven += 1
        moved = self.moved
        if moved is not None:
            moved.append((chain, tokens, 0 if n else 1))
            if len(moved) > 2 * len(self.counted) + 1024:
                self.moved = None

    def drop(self, seq: int) -> None:
        """Take an event out (it left the window or the history); nothing if it was not counted."""
        ev = self.counted.pop(seq, None)
        if ev is None:
            return
        _ts, chain, tokens = ev
        n = self.hits[chain] - 1
        if n:
            self.hits[chain] = n
            self.tokens[chain] -= tokens
        else:
            del self.hits[chain], self.tokens[chain]
        self.changes += 1
        if not (tokens >= 0.0 and tokens % 1.0 == 0.0):
            self.uneven -= 1
        moved = self.moved
        if moved is not None:
            moved.append((chain, -tokens, 0 if n else -1))
            if len(moved) > 2 * len(self.counted) + 1024:
                self.moved = None

    def take_moved(self) -> list[tuple[Chain, float, int]] | None:
        """What moved since the last call (None: too much to tell), and start recording afresh."""
        moved, self.moved = self.moved, []
        return moved

    def advance(self, start: float, end: float, first_seq: int) -> None:
        """Move the window forward to (start, end]; events numbered below ``first_seq`` are gone."""
        self.start, self.end = start, end
        pending = self.pending
        while pending and pending[0][0] <= end:
            ts, seq, chain, tokens = heapq.heappop(pending)
            if seq >= first_seq:
                self.add(seq, ts, chain, tokens)
        leaving, counted = self.leaving, self.counted
        while leaving and leaving[0][0] <= start:
            self.drop(heapq.heappop(leaving)[1])
        if len(leaving) > 2 * len(counted) + 1024:  # entries of events the history dropped: compact
            self.leaving = [(ts, seq) for seq, (ts, _c, _t) in counted.items()]
            heapq.heapify(self.leaving)


def branch_label(block: int) -> str:
    """A branch as shown on /metrics: the first 8 hex digits of its first block's 64-bit hash."""
    return f"{block & 0xFFFFFFFFFFFFFFFF:016x}"[:8]


Walk = tuple[Chain | None, int, int] | None  # (path to the branch point or None, branch, first block)


class BranchResolver:
    """Hit tokens per branch, each chain resolved exactly as ``PrefixIndex.branch_of`` does, with
    the work split by what each part of the answer depends on.

    ``branch_of`` walks a chain from its first block: at the first block that branches in the
    tree statistics (position j, before the last block) the branch is the next block, provided
    blocks 1..j are all in the index; otherwise — a block missing on the way, or no branching
    block — it is the chain's first block. Where j lies depends only on the statistics: it is
    found once per chain and statistics pass. Whether the path up to j is in the index depends
    only on the index: it is checked once per distinct path, and when the index changes the
    known paths are checked again (the chains behind one shared prompt share their path, so
    there are few). ``epoch`` changes only when an answer may have: new statistics, or a path
    that came into or left the index. A read at an unchanged epoch and window costs nothing; at
    an unchanged epoch, a few dictionary look-ups per hit that entered or left the window since
    the last read; at a new epoch, a few per distinct chain of the window.
    """

    MAX_RECHECKED = 4096  # known paths checked again when the index changes; past it, forgotten

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.epoch = 0
        self._stats: TreeStats | None = None
        self._walks: dict[Chain, Walk] = {}  # for ``_stats``
        self._version = -1
        self._path_in_index: dict[Chain, bool] = {}  # at index ``_version``
        # window_totals' sums as of its last read: (window, epoch, tokens and chains per branch)
        self._kept: tuple[WindowTokens, int, dict[int, float], dict[int, int]] | None = None

    def _walk(self, chain: Chain, blocks: Sequence[int], branching: Set[int]) -> Walk:
        if not len(blocks):
            return None
        for j in range(len(blocks) - 1):
            if blocks[j] in branching:
                return (chain[:8 * (j + 1)] if isinstance(chain, bytes) else chain[:j + 1]), blocks[j + 1], blocks[0]
        return None, blocks[0], blocks[0]

    def _in_index(self, path: Chain) -> bool:
        index = self.index
        return all(x in index for x in islice(_blocks(path), 1, None))

    def refresh(self, stats: TreeStats) -> int:
        """Catch up with the statistics and the index; the epoch the answers are now at."""
        if stats is not self._stats:
            self._stats, self._walks = stats, {}
            self.epoch += 1
        version = self.index.version
        if version != self._version:
            self._version = version
            known = self._path_in_index
            if len(known) > self.MAX_RECHECKED:
                self._path_in_index = {}
                self.epoch += 1
            elif any(self._in_index(path) != ok for path, ok in known.items()):
                self._path_in_index = {path: self._in_index(path) for path in known}
                self.epoch += 1
        return self.epoch

    def window_totals(self, w: WindowTokens, stats: TreeStats) -> dict[int, float]:
        """Σ hit tokens per branch of the window's chains (after :meth:`refresh`; the caller only
        reads the result). Kept between reads: at an unchanged epoch a read applies what moved in
        the window since the last one (``WindowTokens.take_moved``), so it costs the hits that came
        and went, not the window's distinct chains. Sums of whole token counts come out the same
        in any order; while the window counts other tokens, every read sums it afresh, in the
        window's order."""
        moved = w.take_moved()
        if stats is not self._stats:
            self.refresh(stats)
        if len(self._walks) > 2 * len(w.tokens) + 1024:  # chains that left the window: walked again if they return
            self._walks = {}
        kept, self._kept = self._kept, None  # (kept again only once what moved is applied whole)
        if (kept is not None and moved is not None and kept[0] is w and kept[1] == self.epoch and not w.uneven
                and self._apply(moved, kept[2], kept[3], stats.branching)):
            self._kept = kept
            return kept[2]
        totals, chains = self._summed(w.tokens, stats.branching)
        self._kept = (w, self.epoch, totals, chains)
        return totals

    def _branch(self, chain: Chain, branching: Set[int]) -> int | None:
        """The branch ``chain`` counts for at this epoch (None: none)."""
        walks = self._walks
        walk = walks.get(chain, _UNWALKED)
        if walk is _UNWALKED:
            walk = walks[chain] = self._walk(chain, _blocks(chain), branching)
        if walk is None:
            return None
        path, b, first = walk
        if path is not None:
            in_index = self._path_in_index
            ok = in_index.get(path)
            if ok is None:
                ok = in_index[path] = self._in_index(path)
            if not ok:
                return first
        return b

    def _apply(self, moved: list[tuple[Chain, float, int]], totals: dict[int, float], chains: dict[int, int],
               branching: Set[int]) -> bool:
        """Apply what moved to the kept sums; False when a sum grew past exact whole numbers."""
        branch = self._branch
        for chain, tok, enters in moved:
            b = branch(chain, branching)
            if b is None:
                continue
            n = chains.get(b, 0) + enters
            if n:
                t = totals[b] = totals.get(b, 0.0) + tok
                chains[b] = n
                if t > _EXACT:
                    return False
            else:  # its last chain left
                del totals[b], chains[b]
        return True

    def _summed(self, tokens: dict[Chain, float], branching: Set[int]) -> tuple[dict[int, float], dict[int, int]]:
        """Σ hit tokens and the number of chains per branch, over ``tokens``' chains in its order."""
        branch = self._branch
        out: dict[int, float] = {}
        chains: dict[int, int] = {}
        for chain, tok in tokens.items():
            b = branch(chain, branching)
            if b is None:
                continue
            out[b] = out.get(b, 0.0) + tok
            chains[b] = chains.get(b, 0) + 1
        return out, chains


_UNWALKED: Walk = (None, -1, -1)  # a marker: never a real walk (it is compared by identity)
_EXACT = float(2 ** 53)  # whole numbers up to here add up exactly, in any order


class Hotspots:
    """Hit and new-session history over the last hour."""

    def __init__(self, index: PrefixIndex, max_events: int = MAX_HISTORY_EVENTS) -> None:
        self.index = index
        self.hit_events: deque[HitEvent] = deque(maxlen=max_events)
        self._interned: dict[Chain, Chain] = {}
        self.session_events: deque[tuple[float, str, bool]] = deque(maxlen=max_events)
        self._next_seq = 0  # sequence number of the next hit event; the deque holds the latest len() of them
        self._window: WindowTokens | None = None  # set by the first hot-branch read
        self._resolver = BranchResolver(index)
        self._ranked: tuple[tuple[object, int, int, int], list[tuple[int, float]]] | None = None

    @property
    def _first_seq(self) -> int:
        return self._next_seq - len(self.hit_events)

    def hit(self, ts: float, chain: Sequence[int], hit_blocks: int, tokens: float, session: str | None) -> None:
        packed = _packed(chain[:min(hit_blocks, MAX_CHAIN_KEPT)])
        shared = self._interned.get(packed)
        if shared is None:
            if len(self._interned) >= MAX_INTERNED:
                self._interned.clear()  # chains still in the history stay alive through their events
            shared = self._interned[packed] = packed
        events, window = self.hit_events, self._window
        if window is not None and len(events) == events.maxlen:
            window.drop(self._first_seq)  # the deque drops its oldest event on this append
        events.append((ts, shared, tokens, session))
        if window is not None:
            window.add(self._next_seq, ts, shared, tokens)
            if len(window.pending) > len(events) // 2 + 1024:
                # Nobody has read the window for a while (every hit is after its end): drop it
                # rather than keep a second history; the next read rebuilds it once.
                self._window = None
        self._next_seq += 1

    def new_session(self, ts: float, segment: str, rekeyed: bool) -> None:
        self.session_events.append((ts, segment, rekeyed))

    def expire(self, now: float) -> None:
        cutoff = now - HISTORY_S
        hits, window = self.hit_events, self._window
        while hits and hits[0][0] <= cutoff:
            if window is not None:
                window.drop(self._first_seq)
            hits.popleft()
        sessions = self.session_events
        while sessions and sessions[0][0] <= cutoff:
            sessions.popleft()

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

    def _window_at(self, start: float, end: float) -> WindowTokens:
        """The incremental window moved to (start, end]; rebuilt from the history only on the
        first read or when a read goes back in time (the input clock never does)."""
        w = self._window
        if w is None or start < w.start or end < w.end:
            w = self._window = WindowTokens(start, end)
            for seq, (ts, chain, tokens, _s) in enumerate(self.hit_events, self._first_seq):
                w.add(seq, ts, chain, tokens)
        else:
            w.advance(start, end, self._first_seq)
        return w

    def hot_branch_tokens(self, k: int, start: float, end: float, stats: TreeStats) -> list[tuple[int, float]]:
        """Top-k branches of hits in (start, end] by hit tokens: (first block, hit tokens).

        The same ranking as :meth:`hot_branches` without the session counts, at a cost that does
        not depend on the history's length (see the module docstring).
        """
        w = self._window_at(start, end)
        key = (stats, self._resolver.refresh(stats), w.changes, k)
        cached = self._ranked
        if cached is not None and cached[0][0] is stats and cached[0][1:] == key[1:]:
            return cached[1]
        totals = self._resolver.window_totals(w, stats)
        # Most tokens first, ties by block: the order hot_branches sorts by, without a key function.
        top = heapq.nsmallest(k, zip(map(neg, totals.values()), totals, strict=True))
        ranked = [(b, -t) for t, b in top]
        self._ranked = (key, ranked)
        return ranked

    # ---- the state file (exporter.loops.state_file): the history outlives a restart ----------
    def saved(self, max_hits: int = MAX_SAVED_HITS, max_chains: int = MAX_SAVED_CHAINS,
              max_sessions: int = MAX_SAVED_SESSIONS) -> dict[str, list]:
        """The newest of the history as plain data, bounded: at most ``max_hits`` hit events whose
        chains (each written once) number at most ``max_chains``, and ``max_sessions`` new sessions."""
        chains: dict[Chain, int] = {}
        hits: list[list] = []
        for ts, chain, tokens, session in reversed(self.hit_events):
            at = chains.get(chain)
            if at is None:
                if len(chains) >= max_chains:
                    break
                at = chains[chain] = len(chains)
            hits.append([ts, at, tokens, session])
            if len(hits) >= max_hits:
                break
        hits.reverse()
        sessions = [list(ev) for ev in islice(reversed(self.session_events), max_sessions)][::-1]
        return {"chains": [list(_blocks(c)) for c in chains], "hits": hits, "sessions": sessions}

    def restore(self, saved: Mapping[str, object], now: float) -> int:
        """Put a saved history back in front of what this process recorded (at start, before any
        input); returns how many entries were malformed and left out. Older than the hour: dropped."""
        bad = 0
        raw_chains = saved.get("chains")
        chains: list[Chain | None] = []
        for c in raw_chains if isinstance(raw_chains, list) else ():
            ok = isinstance(c, list) and all(type(b) is int for b in c)
            chains.append(_packed(c[:MAX_CHAIN_KEPT]) if ok else None)  # type: ignore[index]
            bad += not ok
        cutoff = now - HISTORY_S
        hits: list[HitEvent] = []
        for ev in _rows(saved.get("hits")):
            try:
                ts, at, tokens, session = ev
                chain = chains[at] if type(at) is int and 0 <= at < len(chains) else None
                if chain is None or not _number(ts) or not _number(tokens) or not (
                        session is None or isinstance(session, str)):
                    raise ValueError
            except (TypeError, ValueError):
                bad += 1
                continue
            if ts > cutoff:
                hits.append((float(ts), self._interned.setdefault(chain, chain), float(tokens), session))
        sessions: list[tuple[float, str, bool]] = []
        for ev in _rows(saved.get("sessions")):
            if len(ev) == 3 and _number(ev[0]) and isinstance(ev[1], str) and isinstance(ev[2], bool):
                if ev[0] > cutoff:
                    sessions.append((float(ev[0]), ev[1], ev[2]))
            else:
                bad += 1
        room = (self.hit_events.maxlen or len(hits)) - len(self.hit_events)
        mine = list(self.hit_events)
        self.hit_events.clear()
        self.hit_events.extend(sorted(hits)[-room:] if room > 0 else [])
        self.hit_events.extend(mine)
        self._next_seq += len(self.hit_events) - len(mine)
        self._window = None  # rebuilt from the history at the next read
        self._ranked = None
        mine_s = list(self.session_events)
        self.session_events.clear()
        self.session_events.extend(sorted(sessions))
        self.session_events.extend(mine_s)
        return bad



def _rows(raw: object) -> list[list]:
    return [r if isinstance(r, list) else [] for r in raw] if isinstance(raw, list) else []


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
