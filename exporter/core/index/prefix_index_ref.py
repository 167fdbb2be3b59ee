"""The reference prefix index in plain Python: which worker holds which KV block, and the prefix tree.

It defines the index's semantics and its result types; ``exporter/core/index/_prefix_core.pyx`` is the
compiled index with the same observable behaviour (``exporter.core.index.prefix_index`` picks one at import).

Memory is the constraint (a few million resident blocks), so there are no per-block objects:
one ``dict[int, int]`` maps a block hash to its parent hash and another maps it to a bitmask of
the workers holding it (bit i = worker i of a small worker-id table). A block leaves the tree
when its mask drops to 0. Hit counters are kept per block, only for blocks that were hit.

Tree statistics (radix depth, fan-out, duplication) are defined here as one pass over a copy of
the tree: :meth:`ReferencePrefixIndex.stats_pass` takes the copy with C-level dict/list copies
(the only step that needs the caller's lock) and :func:`compute_stats` does the pass on it,
without the lock. The protocol is sliced (``step`` until it returns True, each call under the
caller's lock): the compiled index keeps every statistic at apply time, leaf depths included,
and its steps settle the depth shifts left queued before one copies them; here one step is all.

Cache tiers: events carry a ``medium`` (GPU, CPU, disk; ``None`` reads as GPU). Each (worker,
medium) is its own view: a removal on one tier never touches another. A worker holds a block
when any of its tiers does (lookups, holders, replicas, the tree); resident counts exist per
worker (any tier) and per (worker, medium). While only one medium has been seen, its view *is*
the worker mask dict (the fast bulk paths below); a second medium switches to per-tier dicts
and an ordered per-hash walk.

Placement from KV events (only once :meth:`ReferencePrefixIndex.set_placement_domains` gave the
workers' NVLink domains; no cost otherwise). Block hashes are content-chained, so a
``BlockStored(hashes=[b1..bm], parent=P)`` on worker w's GPU says w held the chain up to P (or
nothing, P None) and computed b1..bm. Each such event is one placement, judged against the
index as it stood before the event, excluding w and the workers that left the pool
(:meth:`~ReferencePrefixIndex.set_placement_excluded`):

- if other workers hold b1, the workers holding the longest cached prefix are the deepest
  non-empty intersection of the holders of b1, b2, …;
- else they are the holders of P (w itself when it held P);
- with no holder (P None, or nobody holds P) no prefix was resident anywhere: not a placement.

A placement is a domain hit when w's NVLink domain holds one of them. Workers absent from the
domains are not judged (as stores) and hold no domain (as holders). Holders count on any tier.

A store that continues a chain the worker itself stored within the last
``PLACEMENT_CONTINUATION_S`` seconds of the batches' clock (its parent is that chain's last
block: :class:`ChainTails`) is no placement — it is the same request going on. vLLM stores a
request's blocks as they fill: a long prompt chunk by chunk (chunked prefill), and its output a
block at a time while it decodes; counted as placements (nobody else holds their first block,
so each would be an in-domain hit), these would outnumber the requests' own placements ten to
one. The clock comes from :meth:`ReferencePrefixIndex.set_placement_clock` (without it every
store is judged).

What this counts with real vLLM, then: about one judgement per request that stores a block — its
first store. A request whose prompt was fully cached is judged at its first decode block (its
parent, the prompt's last block, is no recent tail: an in-domain hit, rightly). A follow-up turn
sent to the same worker within the window of its previous turn's last full block is taken for a
continuation and not judged (an in-domain placement left out: agents' quick tool-call loops read
a little low); a decode slower than a block per window is judged again (a little high). Request
records with ``block_hashes`` give the exact per-request rate and take precedence
(``exporter.core.record_accounting``).
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from itertools import chain, compress, filterfalse, groupby, islice, repeat
from operator import and_, attrgetter, eq, not_, or_

from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixscope.catalog import PLACEMENT_CONTINUATION_S

ROOT = -1  # parent of root-level blocks; block hashes are unsigned, so -1 never collides
_EDGE_SHIFT = 32  # packed depth: radix edges in the high bits, blocks in the low 32
_EDGE = 1 << _EDGE_SHIFT
_BLOCK_MASK = _EDGE - 1
_HASHES = attrgetter("hashes")
_BULK = 8  # stored runs at least this long go through bulk dict updates; shorter ones are walked
_CHUNK = 1 << 16  # entries per C-level step of a statistics pass (~10 ms each at most)
_consume = deque(maxlen=0).extend  # runs an iterator to its end at C speed (bulk deletes)
DEFAULT_MEDIUM = "GPU"  # what an event without a medium means (vLLM before tiers: the GPU pool)
MAX_MEDIA = 8  # distinct media per index (the compiled index keeps a worker's tiers in 8 bits)
_NO_MEDIUM = object()


def medium_of(ev: object) -> str | None:
    """The tier an event acts on (None for events without one, like AllBlocksCleared)."""
    m = getattr(ev, "medium", _NO_MEDIUM)
    if m is _NO_MEDIUM:
        return None
    return DEFAULT_MEDIUM if m is None else m


class ChainTails:
    """Per worker, the last block of each chain it stored lately and when (the batches' clock):
    a store whose parent is one of them, within ``window`` seconds, continues that chain.

    Both indexes judge through this one object. Each worker's map is pruned of entries older
    than the window whenever it has doubled since its last pruning (at least 64 entries), so it
    holds about the chains stored within the window, twice over at most."""

    __slots__ = ("_kept", "_tails", "now", "window")

    def __init__(self, window: float = PLACEMENT_CONTINUATION_S) -> None:
        self.window = window
        self.now: float | None = None  # the current batch's time; None: no store continues
        self._tails: dict[int, dict[int, float]] = {}  # worker id -> chain's last block -> stored at
        self._kept: dict[int, int] = {}  # worker id -> entries left by its last pruning

    def continues(self, wid: int, parent: int | None, last: int) -> bool:
        """Whether a store on ``wid`` under ``parent`` continues one of its recent chains; the
        store's ``last`` block becomes a tail."""
        now = self.now
        if now is None:
            return False
        tails = self._tails.get(wid)
        if tails is None:
            tails = self._tails[wid] = {}
        seen = tails.get(parent) if parent is not None else None
        tails[last] = now
        if len(tails) > 2 * max(32, self._kept.get(wid, 0)):
            horizon = now - self.window
            for h in [h for h, t in tails.items() if t < horizon]:
                del tails[h]
            self._kept[wid] = len(tails)
        return seen is not None and now - seen <= self.window


@dataclass
class ApplyResult:
    """What one batch of events did to a worker's view (for the KV-event health counters)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_parent: int = 0
    unknown_removals: int = 0
    stored_events: int = 0
    removed_events: int = 0
    # topology-aware placement judged from the GPU stores (only with domains set: ``set_placement_domains``)
    placements: int = 0
    placement_hits: int = 0


@dataclass
class TreeStats:
    """One pass over the tree, its distributions as value -> count maps (what the gauge histograms export).

    Depths are per leaf: ``leaf_depths`` in radix edges (runs without branching count once),
    ``leaf_block_depths`` in blocks; ``fanouts`` counts the children of each branching block."""

    version: int
    nodes: int = 0  # radix nodes (runs without branching count once)
    blocks: int = 0
    root_fanout: int = 0
    leaf_depths: Counter[int] = field(default_factory=Counter)  # radix depth -> leaves
    leaf_block_depths: Counter[int] = field(default_factory=Counter)  # depth in blocks -> leaves
    fanouts: Counter[int] = field(default_factory=Counter)  # children of a branching block (not the root) -> blocks
    replicas: Counter[int] = field(default_factory=Counter)  # workers per block -> number of blocks
    branching: Set[int] = frozenset()  # blocks with two or more children
    # The top of the tree (radix nodes within ``children_depth`` edges of the root), for the API:
    # ROOT or a branching block -> first blocks of its child runs, and first block -> its run
    # (the blocks up to the next branch or leaf; one-block runs are left out).
    children: dict[int, list[int]] = field(default_factory=dict)
    children_depth: int = 0
    runs: dict[int, Sequence[int]] = field(default_factory=dict)

    def run(self, first: int) -> Sequence[int]:
        """The blocks of the radix node starting at ``first`` (just ``first`` outside the kept top)."""
        return self.runs.get(first) or (first,)


@dataclass(frozen=True)
class TreeCopy:
    """What a statistics pass reads, copied from the index at one version."""

    version: int
    parent: dict[int, int]  # block -> parent (ROOT for root-level blocks)
    masks: list[int]  # the holder bitmask of every block (only their bit counts matter)

    def step(self, max_blocks: int = 0) -> bool:
        """The copy was taken whole (the compiled index walks in steps): always complete."""
        return True


@dataclass(frozen=True)
class Match:
    """Longest cached prefix of a block chain: on any worker, and per worker (leading blocks)."""

    blocks: int  # longest match on any worker
    per_worker: dict[str, int]  # worker -> leading blocks it holds (only workers with > 0)

    @property
    def best_workers(self) -> list[str]:
        return sorted(w for w, n in self.per_worker.items() if n == self.blocks and n > 0)

    def depth_on(self, worker: str) -> int:
        """Leading blocks of the chain the worker holds (0 for a worker holding none)."""
        return self.per_worker.get(worker, 0)

    def best_depth(self, excluding: Collection[str] = ()) -> int:
        """The longest match on any worker not in ``excluding`` (``blocks`` when nothing is excluded)."""
        if not excluding:
            return self.blocks
        return max((n for w, n in self.per_worker.items() if w not in excluding), default=0)

    def best_depth_besides(self, worker: str, excluded: Collection[str] = frozenset()) -> int:
        """``best_depth`` excluding ``worker`` and the workers in ``excluded`` (the record path's
        question: every worker but the serving one and those that left the pool)."""
        return max((n for w, n in self.per_worker.items() if w != worker and w not in excluded), default=0)


def _bits(mask: int) -> Iterable[int]:
    """Indexes of the set bits of a worker mask."""
    i = 0
    while mask > 0:
        if mask & 1:
            yield i
        mask >>= 1
        i += 1


class ReferencePrefixIndex:
    """Per-worker resident blocks as bitmasks over one shared block -> parent map."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self._mask: dict[int, int] = {}
        self._hits: dict[int, int] = {}
        self._workers: list[str] = []
        self._wid: dict[str, int] = {}
        self._resident: list[int] = []  # resident block count per worker id
        self._free_ids: list[int] = []
        self._media: list[str] = []
        self._medium_id: dict[str, int] = {}
        self._tier: list[dict[int, int]] = []  # per medium: block -> worker mask (the first *is* _mask until a second medium)
        self._tier_resident: dict[tuple[int, int], int] = {}  # (worker id, medium id) -> blocks, once tiered
        self.version = 0
        # placement judgement (module docstring): worker -> NVLink domain, None while not judged
        self._pl_domains: dict[str, str] | None = None
        self._pl_excluded: frozenset[str] = frozenset()
        self._pl_known = -1  # workers the masks below were built for
        self._pl_masks: dict[str, int] = {}  # domain -> worker mask
        self._pl_out = 0  # worker mask of the excluded workers
        self._pl_tails = ChainTails()

    # ---- worker table ------------------------------------------------------------------
    def _worker_id(self, worker: str) -> int:
        wid = self._wid.get(worker)
        if wid is None:
            wid = len(self._workers)
            self._workers.append(worker)
            self._resident.append(0)
            self._wid[worker] = wid
        return wid

    def _tier_id(self, medium: str) -> int:
        t = self._medium_id.get(medium)
        if t is None:
            if len(self._media) >= MAX_MEDIA:
                raise ValueError(f"more than {MAX_MEDIA} cache media: {[*self._media, medium]}")
            t = len(self._media)
            if t == 1:  # a second medium: the first one's view becomes a dict of its own
                self._tier[0] = dict(self._mask)
                for wid, n in enumerate(self._resident):
                    self._tier_resident[(wid, 0)] = n
            self._media.append(medium)
            self._medium_id[medium] = t
            self._tier.append(self._mask if t == 0 else {})
        return t

    @property
    def tiered(self) -> bool:
        return len(self._media) > 1

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def media(self) -> list[str]:
        """The cache media seen so far, in order of first appearance."""
        return list(self._media)

    def resident_blocks(self, worker: str, medium: str | None = None) -> int | None:
        """Blocks the worker holds on any tier, or on ``medium`` (None for an unknown worker)."""
        wid = self._wid.get(worker)
        if wid is None:
            return None
        if medium is None:
            return self._resident[wid]
        t = self._medium_id.get(medium)
        if t is None:
            return 0
        return self._tier_resident.get((wid, t), 0) if self.tiered else self._resident[wid]

    def resident_by_medium(self) -> dict[str, dict[str, int]]:
        """worker -> medium -> resident blocks, for every known worker and medium."""
        return {w: {m: self.resident_blocks(w, m) or 0 for m in self._media} for w in self._workers}

    def blocks_of(self, worker: str) -> list[int]:
        """The blocks the worker holds on any tier."""
        wid = self._wid.get(worker)
        if wid is None:
            return []
        return [h for h, m in self._mask.items() if m >> wid & 1]

    def __contains__(self, block: int) -> bool:
        return block in self._mask

    def resident_by_worker(self) -> dict[str, int]:
        return dict(zip(self._workers, self._resident, strict=True))

    def holds(self, worker: str, block: int, medium: str | None = None) -> bool:
        """Whether the worker holds the block on any tier, or on ``medium``."""
        wid = self._wid.get(worker)
        if wid is None:
            return False
        if medium is None:
            view = self._mask
        else:
            t = self._medium_id.get(medium)
            if t is None:
                return False
            view = self._tier[t]
        return bool(view.get(block, 0) >> wid & 1)

    def holders(self, block: int) -> list[str]:
        mask = self._mask.get(block, 0)
        return [w for i, w in enumerate(self._workers) if mask >> i & 1]

    def parent(self, block: int) -> int | None:
        p = self._parent.get(block)
        return None if p is None or p == ROOT else p

    def __len__(self) -> int:
        return len(self._mask)

    # ---- placement (module docstring) ----------------------------------------------------------
    def set_placement_domains(self, domains: Mapping[str, str] | None) -> None:
        """Judge each GPU store's placement against these NVLink domains (worker -> domain); None: stop."""
        self._pl_domains = dict(domains) if domains is not None else None
        self._pl_known = -1

    def set_placement_excluded(self, workers: Collection[str]) -> None:
        """Workers whose blocks no placement can use (they left the pool)."""
        self._pl_excluded = frozenset(workers)
        self._pl_known = -1

    def set_placement_clock(self, ts: float | None) -> None:
        """The time of the batch about to be applied (continuations are judged by it)."""
        self._pl_tails.now = ts

    def _placement_masks(self) -> None:
        domains, workers = self._pl_domains or {}, self._workers
        masks: dict[str, int] = {}
        out = 0
        for i, w in enumerate(workers):
            d = domains.get(w)
            if d is not None:
                masks[d] = masks.get(d, 0) | 1 << i
            if w in self._pl_excluded:
                out |= 1 << i
        self._pl_masks, self._pl_out, self._pl_known = masks, out, len(workers)

    def _judge(self, wid: int, hs: Sequence[int], parent: int | None, res: ApplyResult) -> None:
        """One GPU store's placement, before the store is applied."""
        domain = self._pl_domains.get(self._workers[wid]) if self._pl_domains is not None else None
        if domain is None or not hs or self._pl_tails.continues(wid, parent, hs[-1]):
            return
        if self._pl_known != len(self._workers):
            self._placement_masks()
        mask, bit = self._mask, 1 << wid
        others = ~(self._pl_out | bit)
        best = mask.get(hs[0], 0) & others
        if best:  # others held a longer prefix: the deepest non-empty intersection
            for h in hs[1:]:
                deeper = best & mask.get(h, 0)
                if not deeper:
                    break
                best = deeper
        elif parent is not None:
            best = mask.get(parent, 0) & ~(self._pl_out & ~bit)
        if not best:
            return
        res.placements += 1
        if best & self._pl_masks[domain]:
            res.placement_hits += 1

    # ---- events --------------------------------------------------------------------------
    def apply(self, worker: str, events: Iterable[KvEvent]) -> ApplyResult:
        """Apply one worker's events in order; malformed references are counted, never fatal.

        Consecutive events of one type form a group (``groupby``, C-level). A group of removals
        (vLLM sends one event per evicted block) is applied as one batch of hashes and a long
        stored run as bulk dict updates: the cost is the dict operations, about two per block.
        """
        wid = self._worker_id(worker)
        bit = 1 << wid
        res = ApplyResult()
        events = events if isinstance(events, list | tuple) else list(events)
        for m in dict.fromkeys(map(medium_of, events)):  # media in order of first appearance
            if m is not None:
                self._tier_id(m)
        if self.tiered:
            self._apply_tiered(worker, wid, bit, events, res)
            self.version += 1
            return res
        mask, parent = self._mask, self._parent
        get = mask.get
        resident = 0
        for kind, group in groupby(events, type):
            if kind is BlockRemoved:
                evs = list(group)
                hashes = list(chain.from_iterable(map(_HASHES, evs)))
                res.removed_events += len(evs)
                res.removed += len(hashes)
                resident -= self._remove(bit, hashes, res)
            elif kind is BlockStored:
                evs = list(group)
                res.stored_events += len(evs)
                res.stored += sum(map(len, map(_HASHES, evs)))
                unknown = 0
                judge = self._pl_domains is not None
                for ev in evs:
                    hs, p = ev.hashes, ev.parent
                    if judge and (ev.medium or DEFAULT_MEDIUM) == DEFAULT_MEDIUM:
                        self._judge(wid, hs, p, res)
                    prev = ROOT
                    if p is not None:
                        pm = get(p, 0)
                        if not pm & bit:
                            unknown += 1
                        if pm:  # a parent nobody holds leaves the run a root-level orphan
                            prev = p
                    if len(hs) >= _BULK:
                        added = self._store_run(bit, hs, prev)
                        if added >= 0:
                            resident += added
                            continue
                    for h in hs:
                        m = get(h, 0)
                        if not m & bit:
                            mask[h] = m | bit
                            resident += 1
                            if not m:
                                parent[h] = prev
                        prev = h
                res.unknown_parent += unknown
            elif kind is AllBlocksCleared:
                for _ev in group:
                    self._resident[wid] += resident
                    resident = 0
                    self.clear_worker(worker)
                    res.cleared += 1
        self._resident[wid] += resident
        self.version += 1
        return res

    def _apply_tiered(self, worker: str, wid: int, bit: int, events: Sequence[KvEvent], res: ApplyResult) -> None:
        """The ordered walk, hash by hash, once more than one medium is known."""
        mask, parent, tiers, tres, resident = self._mask, self._parent, self._tier, self._tier_resident, self._resident
        for ev in events:
            if isinstance(ev, BlockStored):
                m = medium_of(ev) or DEFAULT_MEDIUM
                if self._pl_domains is not None and m == DEFAULT_MEDIUM:
                    self._judge(wid, ev.hashes, ev.parent, res)
                t = self._medium_id[m]
                tier, key = tiers[t], (wid, t)
                res.stored_events += 1
                res.stored += len(ev.hashes)
                prev, p = ROOT, ev.parent
                if p is not None:
                    pm = mask.get(p, 0)
                    if not pm & bit:
                        res.unknown_parent += 1
                    if pm:
                        prev = p
                for h in ev.hashes:
                    tm = tier.get(h, 0)
                    if not tm & bit:
                        tier[h] = tm | bit
                        tres[key] = tres.get(key, 0) + 1
                        m = mask.get(h, 0)
                        if not m & bit:
                            mask[h] = m | bit
                            resident[wid] += 1
                            if not m:
                                parent[h] = prev
                    prev = h
            elif isinstance(ev, BlockRemoved):
                t = self._medium_id[medium_of(ev) or DEFAULT_MEDIUM]
                tier, key = tiers[t], (wid, t)
                res.removed_events += 1
                res.removed += len(ev.hashes)
                for h in ev.hashes:
                    tm = tier.get(h, 0)
                    if not tm & bit:
                        res.unknown_removals += 1
                        continue
                    if tm & ~bit:
                        tier[h] = tm & ~bit
                    else:
                        del tier[h]
                    tres[key] -= 1
                    if not any(other.get(h, 0) & bit for other in tiers):
                        resident[wid] -= 1
                        self._drop(h, mask[h] & ~bit)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_worker(worker)
                res.cleared += 1

    def _store_run(self, bit: int, hs: tuple[int, ...], prev: int) -> int:
        """A long stored run in bulk, with the ordered walk's result: the blocks new to the worker,
        or -1 (nothing changed) when the chain names a block twice and only the walk is exact."""
        mask, parent = self._mask, self._parent
        n = len(hs)
        before = len(mask)
        if mask.keys().isdisjoint(hs):  # the usual case: every block is new to the tree
            mask.update(zip(hs, repeat(bit), strict=False))
            if len(mask) - before == n:
                parent.update(zip(hs, chain((prev,), hs), strict=False))
                return n
            _consume(map(mask.pop, hs, repeat(None)))  # a block named twice: undo
            return -1
        if len(set(hs)) != n:
            return -1
        held = list(map(mask.get, hs, repeat(0)))
        mask.update(zip(hs, map(or_, held, repeat(bit)), strict=True))
        parent.update(compress(zip(hs, chain((prev,), hs), strict=False), map(not_, held)))  # only blocks new to the tree
        return n - list(map(and_, held, repeat(bit))).count(bit)

    def _remove(self, bit: int, hashes: list[int], res: ApplyResult) -> int:
        """Removals for the worker of ``bit``, in bulk; returns the blocks it actually held.

        Each hash is popped once (a hash named twice pops 0 the second time: unknown, as the
        ordered walk counts it); blocks other workers still hold are put back without this bit.
        """
        mask, hits = self._mask, self._hits
        n = len(hashes)
        held = list(map(mask.pop, hashes, repeat(0)))
        if held.count(bit) == n:  # the usual case: every block was held by this worker alone
            gone: Iterable[int] = hashes
            removed = n
        else:
            removed = list(map(and_, held, repeat(bit))).count(bit)
            res.unknown_removals += n - removed
            rest = list(map(and_, held, repeat(~bit)))
            mask.update(compress(zip(hashes, rest, strict=True), rest))
            gone = list(compress(hashes, map(eq, held, repeat(bit))))
        _consume(map(self._parent.__delitem__, gone))
        if hits:
            _consume(map(hits.pop, gone, repeat(None)))
        return removed

    def _drop(self, h: int, remaining: int) -> None:
        """Set a block's holder mask; with no holder left the block leaves the tree."""
        if remaining:
            self._mask[h] = remaining
        else:
            del self._mask[h]
            del self._parent[h]
            self._hits.pop(h, None)

    def clear_worker(self, worker: str) -> None:
        """Drop every block from one worker's view (restart or AllBlocksCleared); others keep theirs."""
        wid = self._wid.get(worker)
        if wid is None or self._resident[wid] == 0:
            return
        keep = ~(1 << wid)
        mask = self._mask
        if self.tiered:
            for t, tier in enumerate(self._tier):
                for h in [h for h, m in tier.items() if m >> wid & 1]:
                    if tier[h] & keep:
                        tier[h] &= keep
                    else:
                        del tier[h]
                self._tier_resident[(wid, t)] = 0
        # One pass over all blocks: clearing is rare (restarts), so no per-worker block set is kept.
        for h in [h for h, m in mask.items() if m >> wid & 1]:
            self._drop(h, mask[h] & keep)
        self._resident[wid] = 0
        self.version += 1

    # ---- lookups -------------------------------------------------------------------------
    def longest_match(self, block_hashes: Sequence[int]) -> Match:
        """Leading blocks of ``block_hashes`` resident on each worker, and the best of them."""
        mask_of, workers = self._mask, self._workers
        per_worker: dict[str, int] = {}
        alive = -1  # bitmask of workers holding every block so far (-1: not started)
        n = 0
        for h in block_hashes:
            m = mask_of.get(h, 0) & alive
            dropped = alive & ~m if n else 0
            for i in _bits(dropped):
                per_worker[workers[i]] = n
            alive = m
            if not m:
                break
            n += 1
        if n:
            for i in _bits(alive):
                per_worker[workers[i]] = n
        return Match(n, per_worker)

    def record_hits(self, block_hashes: Sequence[int], hit_blocks: int, block_size: int) -> None:
        """Count ``block_size`` hit tokens on each of the first ``hit_blocks`` resident blocks."""
        hits = self._hits
        for h in block_hashes[:hit_blocks]:
            if h in self._mask:
                hits[h] = hits.get(h, 0) + block_size

    def hit_tokens(self, block: int) -> int:
        return self._hits.get(block, 0)

    # ---- statistics ----------------------------------------------------------------------
    def stats_pass(self) -> TreeCopy:
        """The input of a statistics pass: C-level copies, so the caller's lock is held only briefly."""
        return TreeCopy(self.version, self._parent.copy(), list(self._mask.values()))

    def stats(self, keep_children_depth: int = 0) -> TreeStats:
        """A statistics pass over the current tree, synchronously (tests and offline tools)."""
        return compute_stats(self.stats_pass(), keep_children_depth)

    def branch_of(self, block_hashes: Sequence[int], stats: TreeStats) -> int | None:
        """The branch a chain belongs to: the first block of its depth-2 radix node, else of depth 1."""
        if not block_hashes:
            return None
        branching = stats.branching
        for i in range(len(block_hashes) - 1):
            if block_hashes[i] in branching:
                return block_hashes[i + 1]
            if block_hashes[i + 1] not in self:
                break
        return block_hashes[0]


def compute_stats(tree: TreeCopy, keep_children_depth: int = 0) -> TreeStats:
    """Tree statistics in one pass, with the runs and child lists of the top ``keep_children_depth`` edges.

    Pure: reads only ``tree`` (a copy), so it runs without any lock while ingest goes on. Nothing
    per block is built beyond one Counter of parents: depths are walked run by run (see
    :class:`_RunWalk`) and only the kept runs are stored, as 8-byte arrays.

    The bulk C-level steps go in chunks (:func:`_chunks`): one C call over millions of entries
    would hold the GIL for its whole length and stall ingest in the other threads just as a lock would.
    """
    parent = tree.parent
    nchildren: Counter[int] = Counter()
    for chunk in _chunks(parent.values()):
        nchildren.update(chunk)
    root_fanout = nchildren.get(ROOT, 0)
    branching = frozenset(h for h, n in nchildren.items() if n > 1 and h != ROOT)
    fanouts = [nchildren[h] for h in branching if h in parent]
    # Blocks whose parent left the tree start runs of their own at the root.
    orphan_roots = -root_fanout
    for chunk in _chunks(nchildren):
        orphan_roots += sum(map(nchildren.__getitem__, filterfalse(parent.__contains__, chunk)))
    # Leaves are the blocks nobody names as parent.
    leaves: list[int] = []
    for chunk in _chunks(parent):
        leaves.extend(filterfalse(nchildren.__contains__, chunk))
    del nchildren  # the largest transient: free it before the walk
    walk = _RunWalk(parent, branching, keep_children_depth)
    packed = [walk.depth(h) for h in leaves]
    del leaves
    for h in branching:  # runs ending in a branch are kept too (for the tree's top)
        if h in parent:
            walk.depth(h)
    replicas: Counter[int] = Counter()
    for chunk in _chunks(tree.masks):
        replicas.update(map(int.bit_count, chunk))
    return TreeStats(
        version=tree.version,
        nodes=root_fanout + orphan_roots + sum(fanouts),
        blocks=len(tree.masks),
        root_fanout=root_fanout + orphan_roots,
        leaf_depths=Counter(d >> _EDGE_SHIFT for d in packed),
        leaf_block_depths=Counter(d & _BLOCK_MASK for d in packed),
        fanouts=Counter(fanouts),
        replicas=replicas,
        branching=branching,
        children=walk.children,
        children_depth=keep_children_depth,
        runs=walk.runs,
    )


def _chunks(items: Iterable[int], size: int = _CHUNK) -> Iterator[list[int]]:
    """``items`` in lists of ``size``: between them the interpreter can hand the GIL to other threads."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


class _RunWalk:
    """Depths run by run: from a run's end (a leaf or a branching block) up to its start.

    A run's start hangs off the root, a parent that left the tree, or a branching block; only
    branching blocks' depths are remembered, so every block is visited once and nothing per
    block is kept. Depths are packed as ``edges << 32 | blocks``. Runs within ``keep`` edges of
    the root are stored (``runs``, ``children``) for the API's view of the top of the tree.

    A parent cycle (colliding hashes: a block that left the tree comes back under one of its own
    descendants) is cut above its block with the smallest hash: that block starts a run at the
    root, as an orphan does (its parent still counts it as a child). The cut depends on the tree
    alone, not on the order of the walk, so an index that keeps depths at apply time cuts there too.
    """

    def __init__(self, parent: dict[int, int], branching: frozenset[int], keep: int) -> None:
        self.parent, self.branching = parent, branching
        self.limit = (keep + 1) << _EDGE_SHIFT  # packed depths below this are within ``keep`` edges
        self.known: dict[int, int] = {}  # branching block -> packed depth
        self.cut: set[int] = set()  # the smallest hash of each parent cycle met so far
        self.runs: dict[int, Sequence[int]] = {}
        self.children: dict[int, list[int]] = {}

    def _up(self, end: int) -> tuple[list[int], int]:
        """The run ending at ``end`` (end first) and the parent of its start (ROOT above a cut)."""
        parent, branching, cut = self.parent, self.branching, self.cut
        run = [end]
        x = end
        while x not in cut:
            p = parent[x]
            if p in branching or p not in parent:
                return run, p
            run.append(p)
            x = p
            if len(run) > len(parent):  # a cycle with no branching block: no run end reaches it
                break
        return run, ROOT

    def _cut_cycle(self, p: int) -> None:
        """Cut the parent cycle through ``p`` above its smallest hash."""
        parent = self.parent
        low, x = p, parent[p]
        while x != p:
            low = min(low, x)
            x = parent[x]
        self.cut.add(low)

    def depth(self, end: int) -> int:
        """Packed depth of a run end; resolves the branching ancestors it needs (no recursion)."""
        known, parent = self.known, self.parent
        if end in known:
            return known[end]
        stack: list[tuple[int, list[int], int]] = []
        busy: set[int] = set()  # ends waiting for their parent's depth (a repeat means a cycle)
        x, (run, p) = end, self._up(end)
        while True:
            hangs = p in parent  # a branching block in the tree; else the root or a departed parent
            if hangs and p not in known and (p in busy or p == x):  # a parent cycle: cut it, start again
                self._cut_cycle(p)
                stack.clear()
                busy.clear()
                x, (run, p) = end, self._up(end)
                continue
            if hangs and p not in known:
                busy.add(x)
                stack.append((x, run, p))
                x, (run, p) = p, self._up(p)
                continue
            d = (known.get(p, 0) if hangs else 0) + _EDGE + len(run)
            if x in self.branching:
                known[x] = d
            if d < self.limit:
                self._keep(run, p if hangs else ROOT)
            if not stack:
                return d
            x, run, p = stack.pop()
            busy.discard(x)

    def _keep(self, run: list[int], under: int) -> None:
        first = run[-1]
        self.children.setdefault(under, []).append(first)
        if len(run) > 1:  # a one-block run needs no entry: ``TreeStats.run`` returns the block itself
            run.reverse()
            try:
                self.runs[first] = array("Q", run)
            except OverflowError:  # hashes outside u64 (not from the decoder): keep a tuple
                self.runs[first] = tuple(run)
