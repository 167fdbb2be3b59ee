"""The session table: per session key its last worker, turn and follow-up sums, bounded by LRU.

Re-key detection (a cookie reset or key churn hands an ongoing conversation a new key): each
session registers the block hashes of its latest prompt. Chained hashes identify a whole prefix,
so a new key whose first prompt reaches a block that exactly one other recent session holds —
deeper than any prefix two unrelated sessions share (the system prompt) and covering that
session's whole first prompt — continues that session under a new key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

MAX_CHAIN = 512  # blocks of a prompt chain kept per session (re-keys show within the first ones)


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
    chain: tuple[int, ...] = ()
    pool_epoch: int = 0  # pool-change epoch in which the session was last served


@dataclass(frozen=True, slots=True)
class Turn:
    """What one request did to its session."""

    session: Session
    turn: int
    previous_worker: str | None  # None on the first turn
    previous_ts: float | None
    previous_epoch: int | None
    rekey_of: str | None  # on a first turn: the session this key continues, if re-keyed


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, rekey_horizon_s: float = 1800.0) -> None:
        self.max_sessions = max_sessions
        self.rekey_horizon_s = rekey_horizon_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        # block hash -> number of sessions whose chain holds it, and the last such session
        self._count: dict[int, int] = {}
        self._owner: dict[int, str] = {}
        self.shared_depth = 0  # longest prefix (blocks) shared by two unrelated sessions
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def observe(self, key: str, ts: float, worker: str, chain: Sequence[int] | None,
                segment: str | None, epoch: int) -> Turn:
        """Advance the session for one request (turn, last worker, chain) and detect re-keys."""
        s = self._sessions.get(key)
        chain_t = tuple(chain[:MAX_CHAIN]) if chain else ()
        if s is None:
            rekey_of = self._rekey_source(key, chain_t, ts) if chain_t else None
            s = Session(key, worker, ts, ts, segment, first_chain_len=len(chain_t), pool_epoch=epoch)
            self._sessions[key] = s
            self._register(s, chain_t, related=rekey_of)
            self._evict()
            return Turn(s, 1, None, None, None, rekey_of)
        self._sessions.move_to_end(key)
        prev_worker, prev_ts, prev_epoch = s.worker, s.last_ts, s.pool_epoch
        s.turn += 1
        s.worker, s.last_ts, s.pool_epoch = worker, max(s.last_ts, ts), epoch
        if segment:
            s.segment = segment
        if chain_t:
            self._register(s, chain_t)
        return Turn(s, s.turn, prev_worker, prev_ts, prev_epoch, None)

    def _rekey_source(self, key: str, chain: tuple[int, ...], ts: float) -> str | None:
        count, owner = self._count, self._owner
        depth = 0
        for h in chain:
            if h not in count:
                break
            depth += 1
        if depth == 0:
            return None
        deepest = chain[depth - 1]
        if count[deepest] != 1:
            return None
        src = self._sessions.get(owner[deepest])
        if src is None or src.key == key or ts - src.last_ts > self.rekey_horizon_s:
            return None
        # A continuation carries the earlier conversation plus a new turn, so it extends past the
        # match; a first prompt equal to another session's is a second conversation opening alike.
        extends = len(chain) > depth or depth == MAX_CHAIN
        if extends and depth > self.shared_depth and depth >= src.first_chain_len:
            return src.key
        return None

    def _register(self, s: Session, chain: tuple[int, ...], related: str | None = None) -> None:
        """Replace the session's registered chain by ``chain`` and update the sharing depth."""
        old = s.chain
        count, owner = self._count, self._owner
        common = 0
        for a, b in zip(old, chain, strict=False):
            if a != b:
                break
            common += 1
        self._unregister(old[common:], s.key)
        for depth, h in enumerate(chain[common:], start=common + 1):
            n = count.get(h, 0)
            if n and owner.get(h) not in (s.key, related):
                # an unrelated session already holds this prefix: it is shared (system prompt)
                self.shared_depth = max(self.shared_depth, depth)
            count[h] = n + 1
            owner[h] = s.key
        s.chain = chain

    def _unregister(self, hashes: Sequence[int], key: str) -> None:
        count, owner = self._count, self._owner
        for h in hashes:
            n = count.get(h, 0) - 1
            if n <= 0:
                count.pop(h, None)
                owner.pop(h, None)
            else:
                count[h] = n

    def _evict(self) -> None:
        while len(self._sessions) > self.max_sessions:
            _, s = self._sessions.popitem(last=False)
            self._unregister(s.chain, s.key)
            self.evicted += 1

    def expire(self, now: float, horizon_s: float) -> None:
        """Forget sessions idle for longer than ``horizon_s`` (oldest first, LRU order)."""
        while self._sessions:
            key, s = next(iter(self._sessions.items()))
            if now - s.last_ts <= horizon_s:
                break
            del self._sessions[key]
            self._unregister(s.chain, s.key)
            self.evicted += 1
