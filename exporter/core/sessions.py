"""The session table: per session key its last worker, turn and follow-up sums, bounded by LRU.

Re-key detection (a cookie reset or key churn hands an ongoing conversation a new key): chained
block hashes identify a whole prefix, so a new key whose first prompt passes through the end
of exactly one recent session's latest prompt — deeper than any prefix two unrelated sessions
share (the system prompt) and covering that session's whole first prompt — continues that
session under a new key.

A session does not keep its chain (512 blocks would cost ~60 KB a session). It registers a
fingerprint of a few of its latest chain's blocks, its *anchors*: the last block, the block that
ended its first prompt, and the blocks at depths 1, 2, 4, 8, 16, 64 and 256, which is where a prefix
shared with another session is noticed (the shared depth is known to the anchor depth below it). The registry maps an anchor to the one session holding it, or to how many hold it
once several do; a session costs well under 1 KB however long its prompts.

The sessions active in the current window (``active_since``, ``hit_ratios_since``: what /metrics reads) are kept
apart as they are served, so that a scrape reads the window's sessions, not the whole table,
which holds an hour of them (one dictionary entry per session in the window).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

MAX_CHAIN = 512  # blocks of a prompt chain looked at (re-keys show within the first ones)
Pick = Callable[[Sequence[int]], tuple[int, ...]]
# (chain length, first prompt's length) -> the anchor depths, and what picks their blocks from a chain
_DEPTHS: dict[tuple[int, int], tuple[tuple[int, ...], Pick]] = {}
_DEPTHS_KEPT = 4096


def _depths(length: int, first_len: int) -> tuple[tuple[int, ...], Pick]:
    got = _DEPTHS.get((length, first_len))
    if got is None:
        depths = tuple(anchor_depths(length, first_len))
        pick: Pick
        if len(depths) > 1:
            pick = itemgetter(*[d - 1 for d in depths])
        else:
            pick = lambda chain, at=tuple(d - 1 for d in depths): tuple([chain[i] for i in at])  # noqa: E731
        got = (depths, pick)
        if len(_DEPTHS) < _DEPTHS_KEPT:
            _DEPTHS[(length, first_len)] = got
    return got


def anchor_depths(length: int, first_len: int) -> list[int]:
    """The 1-based depths of a chain of ``length`` blocks that a session registers."""
    depths, d = [], 1
    while d < length:
        depths.append(d)
        d *= 2 if d < 16 else 4  # 1, 2, 4, 8, 16, 64, 256: denser where system prompts end
    if 0 < first_len < length and first_len not in depths:
        depths.append(first_len)
    if length:
        depths.append(length)
    return depths


@dataclass(slots=True)
class Session:
    key: str
    worker: str
    first_ts: float
    last_ts: float
    segment: str | None = None
    turn: int = 1
    followup_prompt: float = 0.0
    followup_cached: float = 0.0
    first_chain_len: int = 0
    chain_len: int = 0  # blocks of the latest registered chain
    anchors: tuple[int, ...] = ()  # the registered blocks of that chain (see the module doc)
    pool_epoch: int = 0  # pool-change epoch in which the session was last served
    # KV events that name the session (vLLM >= 0.30 ``BlockStored.session_id``): the last blocks of
    # its latest stores on its worker and when, so a store that goes on with one of its requests
    # (chunked prefill, decode blocks) is told from the next turn; None until a store names it
    kv_tails: dict[int, float] | None = None


class Turn(NamedTuple):
    """What one request did to its session (a tuple: one is made per request record)."""

    session: Session
    turn: int
    previous_worker: str | None  # None on the first turn
    previous_ts: float | None
    previous_epoch: int | None
    rekey_of: str | None  # on a first turn: the session this key continues, if re-keyed


KV_TAILS_KEPT = 4  # a session's requests in flight at once whose stores are told apart (parallel tool calls)


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, rekey_horizon_s: float = 1800.0) -> None:
        self.max_sessions = max_sessions
        self.rekey_horizon_s = rekey_horizon_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        # anchor block hash -> the one session holding it (its key), or how many sessions hold it
        self._held: dict[int, str | int] = {}
        self.shared_depth = 0  # longest prefix (blocks) seen shared by two unrelated sessions
        self.evicted = 0
        # Sessions whose last_ts is after ``_cutoff``, in the table's order: kept from the first
        # ``active_since`` call on (a table nobody reads the window of keeps nothing extra).
        self._active: dict[str, Session] | None = None
        self._cutoff = float("-inf")

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def _served(self, s: Session) -> None:
        """Keep ``_active`` in the table's order (the session moved to its end)."""
        active = self._active
        if active is None:
            return
        active.pop(s.key, None)
        if s.last_ts > self._cutoff:
            active[s.key] = s

    def active_since(self, cutoff: float) -> list[Session]:
        """Sessions served after ``cutoff`` (``last_ts > cutoff``), in the table's order.

        Costs the sessions active since the previous call's cutoff, not the table's size. The
        first call, and one whose cutoff goes back (the input clock never does), read the whole
        table once.
        """
        active = self._active
        if active is None or cutoff < self._cutoff:
            self._active = {k: s for k, s in self._sessions.items() if s.last_ts > cutoff}
        else:
            for key in [k for k, s in active.items() if s.last_ts <= cutoff]:
                del active[key]
        self._cutoff = cutoff
        return list(self._active.values())

    def hit_ratios_since(self, cutoff: float) -> list[float]:
        """``followup_cached / followup_prompt`` of the sessions :meth:`active_since` returns that
        have follow-up prompt tokens, in that order: read in the walk that leaves the sessions
        gone idle behind (/metrics reads it at every scrape; one walk touches each session once)."""
        active = self._active
        if active is None or cutoff < self._cutoff:
            self.active_since(cutoff)
            return [s.followup_cached / s.followup_prompt for s in (self._active or {}).values()
                    if s.followup_prompt > 0]
        ratios: list[float] = []
        idle: list[str] = []
        for key, s in active.items():
            if s.last_ts <= cutoff:
                idle.append(key)
            elif s.followup_prompt > 0:
                ratios.append(s.followup_cached / s.followup_prompt)
        for key in idle:
            del active[key]
        self._cutoff = cutoff
        return ratios

    def observe(self, key: str, ts: float, worker: str, chain: Sequence[int] | None,
                segment: str | None, epoch: int) -> Turn:
        """Advance the session for one request (turn, last worker, chain) and detect re-keys."""
        s = self._sessions.get(key)
        chain_t = chain[:MAX_CHAIN] if chain else ()
        if s is None:
            rekey_of = self._rekey_source(key, chain_t, ts) if chain_t else None
            s = Session(key, worker, ts, ts, segment, first_chain_len=len(chain_t), pool_epoch=epoch)
            self._sessions[key] = s
            self._served(s)
            self._register(s, chain_t, related=rekey_of)
            self._evict()
            return Turn(s, 1, None, None, None, rekey_of)
        self._sessions.move_to_end(key)
        prev_worker, prev_ts, prev_epoch = s.worker, s.last_ts, s.pool_epoch
        s.turn += 1
        if worker != s.worker:
            s.kv_tails = None  # its stores on the worker it left continue nothing here
        s.worker, s.last_ts, s.pool_epoch = worker, max(s.last_ts, ts), epoch
        self._served(s)
        if segment:
            s.segment = segment
        if chain_t:
            self._register(s, chain_t)
        return Turn(s, s.turn, prev_worker, prev_ts, prev_epoch, None)

    def kv_continues(self, key: str, worker: str, parent: int | None, ts: float, window: float) -> bool:
        """Whether a KV store naming session ``key`` on ``worker`` goes on with one of its requests:
        its parent ended one of the session's stores on that worker within ``window`` seconds (the
        rule placement judges a request's first store by, ``prefix_index_ref.ChainTails``)."""
        s = self._sessions.get(key)
        if s is None or parent is None or s.worker != worker or not s.kv_tails:
            return False
        at = s.kv_tails.get(parent)
        return at is not None and ts - at <= window

    def kv_stored(self, key: str, worker: str, last: int | None, ts: float) -> None:
        """The store's last block becomes one of the session's tails (after its turn was observed)."""
        s = self._sessions.get(key)
        if s is None or last is None or s.worker != worker:
            return
        tails = s.kv_tails
        if tails is None:
            tails = s.kv_tails = {}
        tails.pop(last, None)
        tails[last] = ts
        if len(tails) > KV_TAILS_KEPT:
            del tails[next(iter(tails))]  # the oldest (insertion order: each tail is re-inserted when stored)

    def _rekey_source(self, key: str, chain: Sequence[int], ts: float) -> str | None:
        held = self._held
        depth = len(chain)
        while depth and chain[depth - 1] not in held:  # the deepest registered block of the chain
            depth -= 1
        if depth == 0:
            return None
        owner = held[chain[depth - 1]]
        if not isinstance(owner, str):
            return None  # several sessions hold it: no single conversation to continue
        src = self._sessions.get(owner)
        if src is None or src.key == key or ts - src.last_ts > self.rekey_horizon_s:
            return None
        # A continuation carries the earlier conversation plus a new turn, so it extends past the
        # match; a first prompt equal to another session's is a second conversation opening alike.
        extends = len(chain) > depth or depth == MAX_CHAIN
        if extends and depth > self.shared_depth and depth >= src.first_chain_len:
            return src.key
        return None

    def _register(self, s: Session, chain: Sequence[int], related: str | None = None) -> None:
        """Replace the session's anchors by those of ``chain`` and update the sharing depth."""
        depths, pick = _depths(len(chain), s.first_chain_len)
        old = s.anchors
        if old and self._reregister(s, chain, depths, pick(chain), old):
            return
        self._unregister(old, s.key)
        held = self._held
        anchors = []
        for depth in depths:
            h = chain[depth - 1]
            anchors.append(h)
            other = held.get(h)
            if other is None:
                held[h] = s.key
                continue
            if other not in (s.key, related):
                # an unrelated session already holds this prefix: it is shared (system prompt)
                self.shared_depth = max(self.shared_depth, depth)
            held[h] = (2 if isinstance(other, str) else other + 1) if other != s.key else other
        s.anchors, s.chain_len = tuple(anchors), len(chain)

    def _reregister(self, s: Session, chain: Sequence[int], depths: tuple[int, ...], anchors: tuple[int, ...],
                    old: tuple[int, ...]) -> bool:
        """:meth:`_register` of a later turn in one pass, when the old and the new anchors are each
        distinct blocks (False otherwise: the caller takes the two passes). A later turn's chain
        mostly extends the previous one, so most anchors stay; unregistering and registering
        again nets out per block (the blocks are distinct, so each is independent of the others):
        held by this session alone, it stays so; held by several, the count stays and the prefix
        is shared at its depth; by one unknown holder (a count of 1) or nobody, it becomes this
        session's; by another session alone, it becomes shared by two."""
        key, held, shared = s.key, self._held, self.shared_depth
        if anchors == old:
            if len(set(old)) != len(old):
                return False
            for depth, h in zip(depths, anchors, strict=True):
                other = held.get(h)
                if other is None:
                    held[h] = key
                elif type(other) is int:
                    if other <= 1:
                        held[h] = key
                    elif depth > shared:
                        shared = depth
                elif other != key:
                    held[h] = 2
                    if depth > shared:
                        shared = depth
            self.shared_depth = shared
            s.chain_len = len(chain)
            return True
        kept = set(old)
        new = set(anchors)
        if len(kept) != len(old) or len(new) != len(anchors):
            return False
        for h in old:
            if h not in new:
                v = held.get(h)
                if v is None:
                    continue
                if type(v) is str:
                    if v == key:
                        del held[h]
                elif v <= 1:
                    del held[h]
                else:
                    held[h] = v - 1
        for depth, h in zip(depths, anchors, strict=True):
            other = held.get(h)
            if other is None:
                held[h] = key
            elif other == key:
                continue
            elif h in kept:  # out and in again
                if type(other) is str:
                    held[h] = 2
                    if depth > shared:
                        shared = depth
                elif other <= 1:
                    held[h] = key
                elif depth > shared:
                    shared = depth
            else:  # newly registered, held by another session or by several
                held[h] = 2 if type(other) is str else other + 1
                if depth > shared:
                    shared = depth
        self.shared_depth = shared
        s.anchors, s.chain_len = anchors, len(chain)
        return True

    def _unregister(self, anchors: Sequence[int], key: str) -> None:
        held = self._held
        for h in anchors:
            v = held.get(h)
            if v is None:
                continue
            if isinstance(v, str):
                if v == key:
                    del held[h]
            elif v <= 1:
                del held[h]
            else:
                held[h] = v - 1  # one holder left, which one is no longer known: never a re-key source

    def _evict(self) -> None:
        while len(self._sessions) > self.max_sessions:
            _, s = self._sessions.popitem(last=False)
            if self._active is not None:
                self._active.pop(s.key, None)
            self._unregister(s.anchors, s.key)
            self.evicted += 1

    def expire(self, now: float, horizon_s: float) -> None:
        """Forget sessions idle for longer than ``horizon_s`` (oldest first, LRU order)."""
        while self._sessions:
            key, s = next(iter(self._sessions.items()))
            if now - s.last_ts <= horizon_s:
                break
            del self._sessions[key]
            if self._active is not None:
                self._active.pop(key, None)
            self._unregister(s.anchors, s.key)
            self.evicted += 1
