"""Prefix instability from the KV events: new root branches that near-duplicate a recent one.

A system prompt that renders a timestamp or a request id into its first block changes that
block's hash on every request, and with it the hash of every block after it (block hashes are
chained): each request opens a new root branch of the prefix tree and reuses nothing, although
its text is the same as the last request's but for a short early span. Genuinely new prompts
(a new document, a cold session's own system prompt) also open new root branches; what tells
the two apart is the content: an unstable prefix is a *near-duplicate* of a recent root.

So a root branch (a ``BlockStored`` on the GPU with no parent) counts when both hold:

- **new**: its first block was not seen as a root within the window (on any worker — a
  prefix stored again elsewhere is not new);
- **near-duplicate**: the tokens of its opening ``COMPARED_BLOCKS`` blocks equal, from block
  ``s`` on (``1 ≤ s ≤ EARLY_SPAN_BLOCKS``), those of a recent root with another first block,
  and at least ``MIN_SHARED_BLOCKS`` blocks are compared that way. The two differ only in
  their first ``s`` blocks: the short early span.

The content of blocks is not chained: each comparison key is a hash of the tokens themselves
(``token_ids`` of vLLM's BlockStored). Without token ids nothing can be judged, and
:attr:`RootTracker.tokens_seen` stays False: the signal is missing, never 0.

Memory is bounded: at most ``max_roots`` recent roots (last-seen order, oldest forgotten first,
anything older than the window ignored) and, for each, ``EARLY_SPAN_BLOCKS`` content keys and
its first tokens (the early span and a block more, for an example pair). Only root events are looked at, one per new
prefix family, so the hot path (continuations of known chains) pays one ``parent is None`` test.

A batch the compiled KV reader scanned comes as :func:`root_key` triples computed from the payload
(``KvScan.root_keys``: the same digests, Python's own ``hash``, computed in C without a token
object), applied by :meth:`RootTracker.apply_keyed`; the equality tests hold both to :meth:`RootTracker.apply`.

Pure core: no I/O, no clock, no lock (``ClusterState`` calls it under its lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from exporter.core.index.eviction import is_gpu
from exporter.model import BlockStored, KvEvent

# Opening blocks of a root compared with recent roots: 512 tokens on vLLM's 16-token blocks. Two
# genuinely different prompts may share a template line after an id ("Report 3fa9c2e1: summarise
# the report below…"); an unstable system prompt repeats all of itself, so the comparison is long.
COMPARED_BLOCKS = 32
EARLY_SPAN_BLOCKS = 2  # a near-duplicate differs from its twin only within this many first blocks
MIN_SHARED_BLOCKS = 8  # identical blocks after the span needed to call two roots near-duplicates
DEFAULT_MAX_ROOTS = 4096  # recent roots remembered (with their first tokens)
_INT_ONLY = frozenset((int,))


def _ints_only_py(tokens: tuple) -> bool:
    """Every token exactly an int (the compiled ``ints_only`` checks the same, item by item in C)."""
    return _INT_ONLY.issuperset(map(type, tokens))


try:
    from exporter.core.index._prefix_core import ROOT_KEYS
    from exporter.core.index._prefix_core import ints_only as _ints_only
except ImportError:  # no compiled core in this install
    _ints_only = _ints_only_py
    ROOT_KEYS = False  # ``KvScan.root_keys`` usable: the compiled core hashes as this interpreter does


@dataclass(frozen=True)
class NearDuplicate:
    """An example pair: a new root and the recent root it near-duplicates.

    ``span_offset``/``span_length`` locate the tokens that differ (everything after them in the
    compared opening is identical); the token tuples are the two heads: the early span and one
    block more.
    """

    new_root: int
    recent_root: int
    at: float  # input time the new root was stored
    worker: str
    span_offset: int
    span_length: int
    new_tokens: tuple[int, ...]
    recent_tokens: tuple[int, ...]


@dataclass
class RootBatch:
    """Root branches of one KV batch, for the instability series."""

    roots: int = 0  # GPU root branches stored with token ids (judgeable)
    unstable: int = 0  # of those, new and a near-duplicate of a recent root


def differing_span(a: Sequence[int], b: Sequence[int]) -> tuple[int, int]:
    """(offset, length) of the tokens where ``a`` and ``b`` differ, from the first difference to
    the last one (over the shorter length; equal sequences give (0, 0))."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None:
        return 0, 0
    last = next(i for i in range(n - 1, first - 1, -1) if a[i] != b[i])
    return first, last - first + 1


RootKeys = tuple[tuple[int, int, int], ...]


def root_key(ev: BlockStored) -> tuple[int, tuple[int, ...] | None, RootKeys]:
    """What the tracker reads of a GPU root store: (first block, head, content keys).

    ``head``: the first ``EARLY_SPAN_BLOCKS + 1`` blocks' tokens of the compared opening (empty when
    there are no keys), None when nothing can be compared (no token ids, or not all ints); ``keys``:
    see :meth:`RootTracker._keys`.
    """
    first, bs = ev.hashes[0], ev.block_size
    blocks = min(COMPARED_BLOCKS, len(ev.hashes), len(ev.token_ids) // bs if bs > 0 else 0)
    opening = tuple(ev.token_ids[:blocks * bs])
    if blocks == 0 or not _ints_only(opening):  # every token an int (bools are not)
        return first, None, ()
    keys = RootTracker._keys(opening, blocks, bs)
    # only a root with keys can be a twin or have one: the head of one without is never read
    return first, opening[:(EARLY_SPAN_BLOCKS + 1) * bs] if keys else (), keys


@dataclass(slots=True)
class _Root:
    first: int
    seen: float
    head: tuple[int, ...]  # the first EARLY_SPAN_BLOCKS + 1 blocks' tokens, for an example pair (if keys)
    keys: RootKeys


class RootTracker:
    """Recent root branches of the cluster, by first block, and their content keys."""

    def __init__(self, window_s: float, max_roots: int = DEFAULT_MAX_ROOTS) -> None:
        self.window_s = float(window_s)
        self.max_roots = max_roots
        self._roots: OrderedDict[int, _Root] = OrderedDict()  # first block -> last sighting, oldest first
        self._by_key: dict[tuple[int, int, int], int] = {}  # content key -> newest root that has it
        self.tokens_seen = False  # a root event carried token ids: near-duplicates can be judged
        self.example: NearDuplicate | None = None  # the newest near-duplicate pair

    def __len__(self) -> int:
        return len(self._roots)

    def apply(self, worker: str, events: Iterable[KvEvent], ts: float) -> RootBatch:
        out = RootBatch()
        for ev in events:
            if type(ev) is not BlockStored or ev.parent is not None or not ev.hashes or not is_gpu(ev.medium):
                continue
            self._root(worker, *root_key(ev), ts, out)
        return out

    def apply_keyed(self, worker: str, roots: Iterable[tuple[int, tuple[int, ...] | None, RootKeys]],
                    ts: float) -> RootBatch:
        """:meth:`apply` of a batch's GPU root stores given as their :func:`root_key` (the compiled
        reader computes them from the payload: ``KvScan.root_keys``)."""
        out = RootBatch()
        for first, head, keys in roots:
            self._root(worker, first, head, keys, ts, out)
        return out

    def _root(self, worker: str, first: int, head: tuple[int, ...] | None, keys: RootKeys, ts: float,
              out: RootBatch) -> None:
        if head is None:
            self._remember(first, ts, (), ())  # seen (not new next time), nothing to compare
            return
        self.tokens_seen = True
        out.roots += 1
        cutoff = ts - self.window_s
        known = self._roots.get(first)
        if known is None or known.seen < cutoff:
            twin = self._twin(first, keys, cutoff)
            if twin is not None:
                out.unstable += 1
                offset, length = differing_span(head, twin.head)
                self.example = NearDuplicate(first, twin.first, ts, worker, offset, length, head, twin.head)
        self._remember(first, ts, head, keys)

    @staticmethod
    def _keys(opening: tuple[int, ...], blocks: int, bs: int) -> tuple[tuple[int, int, int], ...]:
        """(s, blocks, digest of the tokens from block ``s`` on) for each span ``s`` that leaves
        enough blocks to compare. The digests nest (block ``s``'s tokens with the digest from
        ``s + 1`` on), so the long tail is hashed once rather than once per span."""
        if blocks - 1 < MIN_SHARED_BLOCKS:
            return ()
        digest = hash(opening[EARLY_SPAN_BLOCKS * bs:])
        keys = [(EARLY_SPAN_BLOCKS, blocks, digest)] if blocks - EARLY_SPAN_BLOCKS >= MIN_SHARED_BLOCKS else []
        for s in range(EARLY_SPAN_BLOCKS - 1, 0, -1):
            digest = hash((opening[s * bs:(s + 1) * bs], digest))
            if blocks - s >= MIN_SHARED_BLOCKS:
                keys.append((s, blocks, digest))
        keys.reverse()  # by rising span, as the twin search tries them
        return tuple(keys)

    def _twin(self, first: int, keys: tuple[tuple[int, int, int], ...], cutoff: float) -> _Root | None:
        """The recent root (another first block) whose opening matches one of ``keys``."""
        for key in keys:
            other = self._by_key.get(key)
            if other is None or other == first:
                continue
            root = self._roots.get(other)
            if root is not None and root.seen >= cutoff and key in root.keys:
                return root
        return None

    def _remember(self, first: int, ts: float, head: tuple[int, ...],
                  keys: tuple[tuple[int, int, int], ...]) -> None:
        roots = self._roots
        old = roots.pop(first, None)
        if old is not None and not keys:  # a sighting without tokens keeps what was known
            head, keys = old.head, old.keys
        elif old is not None:
            self._drop_keys(first, old.keys)
        roots[first] = _Root(first, max(ts, old.seen) if old is not None else ts, head, keys)
        for key in keys:
            self._by_key[key] = first
        while len(roots) > self.max_roots:
            gone, root = roots.popitem(last=False)
            self._drop_keys(gone, root.keys)

    def _drop_keys(self, first: int, keys: tuple[tuple[int, int, int], ...]) -> None:
        for key in keys:
            if self._by_key.get(key) == first:
                del self._by_key[key]

    def clear(self) -> None:
        self._roots.clear()
        self._by_key.clear()
        self.example = None
