"""Which expert signature a cached prefix should route to: the recent majority, in bounded memory.

A prefix hit is aligned when its MoE expert signature matches the prefix's usual one. The usual
one follows the majority of the last :data:`RECENT` signatures seen for that prefix, not the
first ever seen: after an intended gating change the new signature outnumbers the old within
a few requests, takes over, and alignment recovers. The incumbent keeps a tie, so random
misrouting (a different odd signature each time) never takes over from the prefix's own.

Memory: :data:`RECENT` signatures for each of at most ``max_prefixes`` prefixes, the least
recently seen prefix forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict

RECENT = 8  # signatures remembered per prefix
MAX_PREFIXES = 100_000


def majority(recent: tuple[str, ...], incumbent: str | None = None) -> str | None:
    """The most frequent signature of ``recent``; ``incumbent`` keeps a tie (else the newest wins it)."""
    counts: dict[str, int] = {}
    for sig in reversed(recent):  # newest first: on a tie, the first counted wins
        counts[sig] = counts.get(sig, 0) + 1
    if not counts:
        return incumbent
    best = max(counts, key=counts.__getitem__)
    if incumbent is not None and counts.get(incumbent, 0) >= counts[best]:
        return incumbent
    return best


class ExpertSignatures:
    """Per prefix (its first block hash), its usual expert signature and the recent ones."""

    def __init__(self, recent: int = RECENT, max_prefixes: int = MAX_PREFIXES) -> None:
        self.recent = recent
        self.max_prefixes = max_prefixes
        self._seen: OrderedDict[int, tuple[str, tuple[str, ...]]] = OrderedDict()  # prefix -> (usual, recent)

    def __len__(self) -> int:
        return len(self._seen)

    def expected(self, prefix: int) -> str | None:
        """The signature a hit on ``prefix`` should carry now (None: prefix not seen)."""
        seen = self._seen.get(prefix)
        return seen[0] if seen is not None else None

    def observe(self, prefix: int, signature: str) -> None:
        usual, recent = self._seen.get(prefix, (signature, ()))
        recent = (*recent[-(self.recent - 1):], signature) if self.recent > 1 else (signature,)
        self._seen[prefix] = (majority(recent, usual) or signature, recent)
        self._seen.move_to_end(prefix)
        if len(self._seen) > self.max_prefixes:
            self._seen.popitem(last=False)
