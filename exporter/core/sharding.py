"""How N exporter processes split one cluster and still give one answer (pure; no I/O).

Four rules, each chosen so the shards' series pooled by the generated recording rules (``sum``
of numerators and of denominators, of histogram buckets, of a worker's resident blocks) are
what one exporter would export:

**Workers → home shard** (``home_shard``: a stable hash of the worker name, modulo N). A worker's
home shard scrapes its /metrics and owns its KV-stream health: batches, lag, last timestamp,
sequence gaps, missed batches and restarts are counted there only. Every shard still sees every
batch (with its own families' events, possibly none), so a worker is alive in every shard's pool
and pool changes agree. Routers are scraped by shard 0 alone, or their decisions would be
counted N times.

**Prefix families → owning shard** (``family_shard``: a 64-bit mix of the family's root hash,
modulo N). Every shard reads every worker's KV batches, in the one total order of the JetStream
stream (all shards and a single exporter see the same interleaving of workers), and keeps only
the events of the families it owns. A block's *family* is the root of its chain, decided by the
:class:`FamilyRouter` exactly as the prefix index links blocks:

* a BlockStored run whose parent is in the tree (some worker holds it, any tier) joins the
  parent's family; a run whose parent is None starts the family of its first block; a run whose
  parent nobody holds (the index makes it a root-level orphan) takes the missing parent's hash
  as its family, so a late-joined chain lands where its root would;
* a block keeps its family while any worker holds it (a run that reaches an already-held block
  continues in that block's family: the event is split at the boundary, each part to its owner);
* BlockRemoved goes to the removed block's family (a block nobody holds: to the shard of its own
  hash, so exactly one shard counts the unknown removal); AllBlocksCleared and restarts go to
  every shard.

**Request records → the owner of their chain's family** (:func:`record_shard`). Every shard is
sent every record and keeps those whose first block hash is a family it owns (a chain's first
block is a root, and a root's family is its own hash, so every shard decides alike from the
record alone, whatever KV events it has applied yet). The record's "available" lookup, the hits
it adds to hot branches and eviction reuse, and its session all meet the blocks they are about;
a record without hashes goes by its session key, else by its worker's home shard.

**Prefix instability → judged over every root, counted by the root's owner** (:class:`SharedRoots`).
A root and its near-duplicate twin (a timestamp in the first block) have different first blocks,
so they are different families and may live on different shards. Every shard's tracker is fed
every root branch of the stream in stream order, so it makes one exporter's decisions, and a
new root is counted only by the shard that owns its family: the sum over shards is exact. (Keying
families by content instead — e.g. the tokens after the early span — would keep twins together
but could not route a record, which carries hashes and no tokens, without waiting for its KV
events.)

So every connected part of the prefix tree lies in one shard, and per-block holder masks are
complete where they live. What is then exact, as sums or unions over shards (tests/scale,
tests/e2e/test_shards.py): every counter and histogram on /metrics (record counters, reuse
decomposition, cold prefill, miss cost, sessions, stream health, instability); resident blocks
per worker and per medium; the tree statistics (disjoint subtrees, so the gaugehistograms add in
Prometheus); duplication across workers; ``longest_match`` ("available") through
:func:`owner_of_chain` (or :func:`combined_match` over all shards); and from those the checks'
values, the five groups' statuses and the diagnosis chain's verdict, as the recording rules
compute them over all shards. Stored/removed event counts are exact unless a run crosses
families (only after an orphan run) or one BlockRemoved names blocks of several families (vLLM
sends one hash per removal).

The bounds (not exact, by design):

* a session whose records start with different first blocks (its system prompt itself changes)
  is accounted on several shards: its follow-ups, collisions and hit ratio are split by family;
* "still healthy" for a sticky collision reads the pool, whose scrape-reported down targets only
  the worker's home shard knows (batches and records keep every worker alive on every shard);
* hot branches are top K per shard: the cluster's top K is the top K of the shards' lists (each
  branch lives on one shard), not their sum; ``effective_cache_value`` and the removal rank per
  worker are a shard's part, and ``session_reshuffle_ratio`` is a share of the shard's sessions;
* ``prefixscope_records_ingested_total`` counts what each shard received (every record, N times);
* resident blocks per adapter and tenant are kept by family like the index (each shard reads every
  batch's labels and keeps its families' blocks): their sums are exact, their top K is per shard.

The one assumption: a block whose parent left every worker stays a root of its own (the
index's orphan) until that parent is stored again — if the parent then comes back in another
family, the two shards each hold part of one subtree and their statistics differ from one
index's by that link. It needs a chain evicted top-down on every worker that holds it; vLLM
frees a request's blocks tail first, so a worker evicts a chain leaf first (the property test
generates such streams; ``combined_match`` stays exact regardless).

Cost: each shard keeps the family table (two dict entries per resident block in the cluster,
about 100–150 B/block in CPython) and the recent-root tracker (bounded) besides its own part of
the index, and reads every batch of the stream.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from itertools import groupby
from typing import Protocol

from exporter.core.attribution import KvAttribution
from exporter.core.index.prefix_index import ROOT, Match, TreeStats
from exporter.core.index.prefix_instability import DEFAULT_MAX_ROOTS, RootBatch, RootTracker
from exporter.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEvent,
    KvSink,
    unlabelled_events,
)
from prefixscope.records import RequestRecord

DEFAULT_MEDIUM = "GPU"
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class ShardSpec:
    """This process is shard ``index`` of ``count`` (``count == 1``: not sharded)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count}: need 0 <= index < count")

    @property
    def sharded(self) -> bool:
        return self.count > 1


UNSHARDED = ShardSpec()  # one exporter: shard 0 of 1


def home_shard(worker: str, count: int) -> int:
    """The shard that scrapes a worker and owns its stream health (stable across processes)."""
    return int.from_bytes(blake2b(worker.encode(), digest_size=8).digest(), "big") % count


def _mix64(x: int) -> int:
    """splitmix64's finaliser: engine hashes are uniform already, but a test's small ints are not."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def family_shard(root: int, count: int) -> int:
    """The shard that owns the prefix family rooted at block hash ``root``."""
    return _mix64(root & _M64) % count


class FamilyRouter:
    """Which family every resident block belongs to, from every worker's events (see the module doc).

    Every shard runs one over the same input; ``route`` returns the part of a batch that shard
    ``spec.index`` owns, in order. Holders are kept per (worker, medium) so a removal on one tier
    leaves a block in the tree while another tier or worker holds it, as in the index.
    """

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self._family: dict[int, int] = {}  # block -> family root, for blocks some worker holds
        self._holders: dict[int, int] = {}  # block -> bitmask over (worker, medium) slots
        self._slot: dict[tuple[str, str], int] = {}
        self._worker_slots: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._family)

    def family_of(self, block: int) -> int | None:
        return self._family.get(block)

    def owns(self, family: int) -> bool:
        return family_shard(family, self.spec.count) == self.spec.index

    def owns_block(self, block: int) -> bool:
        """The block is in the tree and its family is this shard's (after :meth:`route` saw it)."""
        f = self._family.get(block)
        return f is not None and self.owns(f)

    def _bit(self, worker: str, medium: str | None) -> int:
        key = (worker, medium or DEFAULT_MEDIUM)
        i = self._slot.get(key)
        if i is None:
            i = self._slot[key] = len(self._slot)
            self._worker_slots[worker] = self._worker_slots.get(worker, 0) | 1 << i
        return 1 << i

    def _worker_bits(self, worker: str) -> int:
        return self._worker_slots.get(worker, 0)

    def route(self, batch: KvBatch) -> tuple[KvEvent, ...]:
        """Update the family table with the batch; return this shard's events of it, in order."""
        out: list[KvEvent] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                out.extend(self._stored(batch.worker, ev))
            elif isinstance(ev, BlockRemoved):
                out.extend(self._removed(batch.worker, ev))
            elif isinstance(ev, AllBlocksCleared):
                self.worker_restarted(batch.worker)
                out.append(ev)
        return tuple(out)

    def _stored(self, worker: str, ev: BlockStored) -> list[KvEvent]:
        fam, holders = self._family, self._holders
        bit = self._bit(worker, ev.medium)
        p = ev.parent
        cur = fam.get(p, p) if p is not None else ev.hashes[0]
        segments: list[tuple[int, int]] = []  # (family, start index)
        for i, h in enumerate(ev.hashes):
            f = fam.get(h)
            if f is None:
                fam[h] = cur
                holders[h] = bit
            else:
                holders[h] |= bit
                cur = f
            if not segments or segments[-1][0] != cur:
                segments.append((cur, i))
        if len(segments) == 1:
            return [ev] if self.owns(segments[0][0]) else []
        out: list[KvEvent] = []
        n = len(ev.hashes)
        for k, (f, start) in enumerate(segments):
            if not self.owns(f):
                continue
            end = segments[k + 1][1] if k + 1 < len(segments) else n
            part = ev.hashes[start:end]
            parent = self._part_parent(worker, ev, start, f)
            out.append(BlockStored(part, parent, ev.block_size, ev.token_count * len(part) // n, ev.medium))
        return out

    def _part_parent(self, worker: str, ev: BlockStored, start: int, family: int) -> int | None:
        """The parent to give one part of a split run, so the owner's index counts what one index would.

        A part that starts inside the run starts at a block already held (its parent link stays),
        so it needs none. The first part keeps the event's parent if that parent lives in the same
        family; if it lives elsewhere, the owner cannot see it: pass it only when this worker does
        not hold it (an unknown parent, counted once as in one index), else None.
        """
        p = ev.parent
        if start > 0 or p is None:
            return None
        if self._family.get(p, p) == family:
            return p
        return None if self._holders.get(p, 0) & self._worker_bits(worker) else p

    def _removed(self, worker: str, ev: BlockRemoved) -> list[KvEvent]:
        fam, holders = self._family, self._holders
        bit = self._bit(worker, ev.medium)
        groups: list[tuple[int, list[int]]] = []
        for h in ev.hashes:
            f = fam.get(h, h)
            m = holders.get(h)
            if m is not None and m & bit:
                if m & ~bit:
                    holders[h] = m & ~bit
                else:
                    del holders[h], fam[h]
            if self.owns(f):
                if groups and groups[-1][0] == f:
                    groups[-1][1].append(h)
                else:
                    groups.append((f, [h]))
        if len(groups) == 1 and len(groups[0][1]) == len(ev.hashes):
            return [ev]
        return [BlockRemoved(tuple(hs), ev.medium) for _, hs in groups]

    def worker_restarted(self, worker: str) -> None:
        """Drop a worker from every block (restart or AllBlocksCleared); a scan, as in the index."""
        bits = self._worker_bits(worker)
        if not bits:
            return
        holders, fam = self._holders, self._family
        for h in [h for h, m in holders.items() if m & bits]:
            m = holders[h] & ~bits
            if m:
                holders[h] = m
            else:
                del holders[h], fam[h]


def record_shard(record: RequestRecord, count: int) -> int:
    """The shard that accounts a request record: the owner of its chain's family, so the record's
    "available" lookup, hot-branch hits and eviction reuse meet the blocks they are about.

    A chain's first block is a root (vLLM chains start with no parent), and a root's family is its
    own hash, so the owner follows from the record alone — every shard decides the same without
    waiting for the record's KV events. A record without block hashes goes by its session key (a
    session's records stay together), else by its worker's home shard.
    """
    if record.block_hashes:
        return family_shard(record.block_hashes[0], count)
    if record.session_key:
        return home_shard("session:" + record.session_key, count)
    return home_shard(record.worker, count)


class RecordSink(Protocol):
    def ingest_records(self, records: Sequence[RequestRecord], received_at: float) -> None: ...

    def observe_cold_baselines(self, records: Sequence[RequestRecord], received_at: float) -> None: ...

    def signal_seen(self, signal: str, ts: float) -> None: ...


class ShardRecords:
    """A record sink that passes on only the records this shard owns (:func:`record_shard`).

    Every shard is sent every record (each POSTs to all shards, or all tail the same file), so
    the records' counters are partitioned, not duplicated: their sum over shards is one
    exporter's. The intake's own count (``prefixscope_records_ingested``) is of what each shard
    received.

    The records of other shards still join this shard's cold-prefill baseline (and nothing else):
    the miss-cost SLO judges each missed request against the cluster's cold baseline, so every
    shard must hold the whole of it. Runs of kept and passed-on records reach the state in the
    stream's order, so each baseline sees what one exporter's sees when it judges a request.
    """

    def __init__(self, state: RecordSink, spec: ShardSpec) -> None:
        self.state = state
        self.spec = spec

    def ingest_records(self, records: Sequence[RequestRecord], received_at: float) -> None:
        count, index = self.spec.count, self.spec.index
        for owned, run in groupby(records, key=lambda r: record_shard(r, count) == index):
            deliver = self.state.ingest_records if owned else self.state.observe_cold_baselines
            deliver(list(run), received_at)

    def signal_seen(self, signal: str, ts: float) -> None:
        self.state.signal_seen(signal, ts)


class SharedRoots(RootTracker):
    """Prefix instability with shards: every shard judges every root, each counts the roots it owns.

    A root and its near-duplicate twin differ in their first block, so they are different families
    and may live on different shards: a shard that saw only its own roots would miss the twin. So
    each shard's tracker is fed every root branch of the stream (by :class:`ShardSink`, in the
    stream's one order — the same decisions as one exporter's tracker), and a root is counted by
    the shard that owns its family. Sum over shards = one exporter's count, exactly; each shard
    remembers every recent root (bounded by ``max_roots``, as one exporter).

    The state calls :meth:`apply` with its own events; it gets the counts of the roots this shard
    owns among those the sink fed since the last call.
    """

    def __init__(self, window_s: float, max_roots: int = DEFAULT_MAX_ROOTS) -> None:
        super().__init__(window_s, max_roots)
        self._owned = RootBatch()

    def observe(self, worker: str, events: Sequence[KvEvent], ts: float, owned: bool) -> None:
        """One root event of the stream (every shard sees it); counted here when ``owned``."""
        got = RootTracker.apply(self, worker, events, ts)
        if owned:
            self._owned.roots += got.roots
            self._owned.unstable += got.unstable

    def apply(self, worker: str, events: Iterable[KvEvent], ts: float) -> RootBatch:
        out, self._owned = self._owned, RootBatch()
        return out


class FamilyKvSink(Protocol):
    """A state that can apply a batch or a restart without its stream-health series (ClusterState)."""

    def apply_kv_batch(self, batch: KvBatch, received_at: float, stream: bool = True) -> None: ...

    def worker_restarted(self, worker: str, stream: bool = True) -> None: ...


STREAM_GAUGES = ("prefixscope_kv_event_last_timestamp_seconds", "prefixscope_kv_event_lag_seconds")


class GaugeOwner(Protocol):
    def remove(self, metric: str, labels: tuple[str, ...]) -> None: ...


class ShardSink:
    """A KV sink that passes one shard's families to the state, and stream health to home shards.

    A batch reaches the state when it has events of this shard's families, or when this is the
    worker's home shard (with the shard's events only, possibly none), so the batch, lag and
    last-timestamp series of a worker exist on exactly one shard. Restarts reach every shard.
    """

    def __init__(self, state: KvSink, spec: ShardSpec, router: FamilyRouter | None = None,
                 health: GaugeOwner | None = None, roots: SharedRoots | None = None,
                 stream_aware: bool = False, attribution: KvAttribution | None = None) -> None:
        """``roots``: the state's root tracker (``ClusterState.roots``, replaced by a SharedRoots), so
        prefix instability is judged over every root; None where the state keeps no tracker.
        ``attribution``: the state's adapter/tenant tracker; it is handed every batch's decoded
        events and keeps the labelled blocks of this shard's families, so the shards' resident
        blocks per adapter and tenant add up to one exporter's, as the index's parts do."""
        self.state = state
        self.spec = spec
        self.router = router or FamilyRouter(spec)
        self.attribution = attribution
        if attribution is not None:
            attribution.keeps = self.router.owns_block
        self.health = health
        self.roots = roots
        # a ClusterState leaves stream health to the home shard itself; a plain KvSink (tests) is
        # given whole batches and its stale gauges removed
        self.stream_aware = stream_aware

    def home(self, worker: str) -> bool:
        """This shard owns the worker's stream health (batches, lag, gaps, restarts)."""
        return home_shard(worker, self.spec.count) == self.spec.index

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        if self.roots is not None:
            self._observe_roots(batch, received_at)
        events = self.router.route(batch)
        home = self.home(batch.worker)
        if events or home or self.stream_aware:
            if len(events) != len(batch.events) or any(a is not b for a, b in zip(events, batch.events, strict=False)):
                batch = KvBatch(batch.worker, batch.seq, batch.ts, events, batch.dp_rank, self._labelled(batch))
            if home:
                self.state.apply_kv_batch(batch, received_at)
            elif self.stream_aware:
                # Every shard sees every batch, events or not: the worker is alive on every shard's
                # pool (pool changes and "still healthy" agree). Its stream-health series stay on
                # its home shard: another shard's last timestamp would only move with its families'
                # batches (a false "stream stale"), and batches would be counted once per shard.
                self.state.apply_kv_batch(batch, received_at, stream=False)  # type: ignore[call-arg]
            else:
                self.state.apply_kv_batch(batch, received_at)
                if self.health is not None:
                    for gauge in STREAM_GAUGES:
                        self.health.remove(gauge, (batch.worker,))

    def _labelled(self, batch: KvBatch) -> tuple[object, ...] | None:
        """The whole batch's decoded events for attribution (which filters by family itself), or
        None when attribution is off. A scanned batch carries no labels: its events come from the
        reader's arrays (no second decode), and only if the worker holds labelled blocks here
        (its removals may take some away)."""
        if self.attribution is None:
            return None
        if batch.scan is not None:
            if not batch.attributed:  # type: ignore[attr-defined]
                return None
            return unlabelled_events(batch) if self.attribution.holds_labels(batch.worker) else ()
        return batch.label_events

    def _observe_roots(self, batch: KvBatch, received_at: float) -> None:
        """Every root branch of the batch to the shared tracker, before routing: a root's family is
        its first block's (its own hash, or the family of that block if some worker holds it)."""
        roots, fam = self.roots, self.router._family
        assert roots is not None
        for ev in batch.events:
            if type(ev) is BlockStored and ev.parent is None and ev.hashes:
                # the family the router gives the event's first segment: so the owner applies it
                owner = family_shard(fam.get(ev.hashes[0], ev.hashes[0]), self.spec.count)
                roots.observe(batch.worker, (ev,), received_at, owner == self.spec.index)

    def worker_restarted(self, worker: str) -> None:
        """Every shard clears the worker's blocks; its home shard counts the restart."""
        self.router.worker_restarted(worker)
        if self.stream_aware and not self.home(worker):
            self.state.worker_restarted(worker, stream=False)  # type: ignore[call-arg]
        else:
            self.state.worker_restarted(worker)

    def reset_view(self, worker: str) -> None:
        """A rebuild of the worker's view starts: every shard forgets its part of it."""
        self.state.reset_view(worker)

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """(No NATS stream asks for a rebuild today: this passes the KvSink call on.)"""
        self.state.view_repaired(worker, reason, reliable)


# ---- one answer from N shards ------------------------------------------------------------------
class HoldsBlocks(Protocol):
    def longest_match(self, block_hashes: Sequence[int]) -> Match: ...

    def holders(self, block: int) -> list[str]: ...


def owner_of_chain(router: FamilyRouter, block_hashes: Sequence[int]) -> int | None:
    """The shard whose families hold a request's chain (None when nobody holds its first block)."""
    if not block_hashes:
        return None
    f = router.family_of(block_hashes[0])
    return None if f is None else family_shard(f, router.spec.count)


def combined_match(indexes: Sequence[HoldsBlocks], block_hashes: Sequence[int]) -> Match:
    """``longest_match`` over the union of the shards' indexes (each block lives in one shard).

    Walks the chain block by block, as the index does, asking each shard for the block's holders:
    exact whatever families the chain crosses.
    """
    alive: set[str] | None = None
    per_worker: dict[str, int] = {}
    n = 0
    for h in block_hashes:
        held = set().union(*(ix.holders(h) for ix in indexes))
        now = held if alive is None else alive & held
        for w in (alive or set()) - now:
            per_worker[w] = n
        alive = now
        if not alive:
            break
        n += 1
    for w in alive or ():
        per_worker[w] = n
    return Match(n, per_worker)


def merge_tree_stats(parts: Iterable[TreeStats]) -> TreeStats:
    """The statistics of the union of disjoint subtrees (one per shard)."""
    out = TreeStats(version=0, replicas=Counter(), children={})
    branching: set[int] = set()
    depth: int | None = None
    for s in parts:
        out.version += s.version
        out.nodes += s.nodes
        out.blocks += s.blocks
        out.root_fanout += s.root_fanout
        out.leaf_depths.update(s.leaf_depths)
        out.leaf_block_depths.update(s.leaf_block_depths)
        out.fanouts.update(s.fanouts)
        out.replicas.update(s.replicas)
        branching.update(s.branching)
        for k, v in s.children.items():
            if k == ROOT:
                out.children.setdefault(ROOT, []).extend(v)
            else:
                out.children.setdefault(k, v)
        out.runs = {**out.runs, **s.runs}
        depth = s.children_depth if depth is None else min(depth, s.children_depth)
    out.branching = frozenset(branching)
    out.children_depth = depth or 0
    return out


# ---- the plan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardPlan:
    count: int
    workers: Mapping[int, tuple[str, ...]]  # shard -> workers it scrapes and owns the stream health of
    routers: Mapping[int, tuple[str, ...]]

    def lines(self) -> list[str]:
        out = [f"{self.count} shard(s). Prefix families: shard = splitmix64(root block hash) mod {self.count}; "
               "every shard reads every worker's KV subject and keeps its families' events.",
               "Request records: send every record to every shard; each keeps those whose first block's family "
               "it owns (no block hashes: by session key, else the worker's shard)."]
        for i in range(self.count):
            ws, rs = self.workers.get(i, ()), self.routers.get(i, ())
            out.append(f"shard {i}: {len(ws)} worker(s): {', '.join(ws) or '-'}"
                       + (f"; router(s): {', '.join(rs)}" if rs else ""))
        return out


def plan(workers: Iterable[str], routers: Iterable[str], count: int) -> ShardPlan:
    by: dict[int, list[str]] = {i: [] for i in range(count)}
    for w in sorted(workers):
        by[home_shard(w, count)].append(w)
    return ShardPlan(count, {i: tuple(v) for i, v in by.items()}, {0: tuple(sorted(routers))})
