"""What eviction costs, per worker, from the KV events: thrash, eviction age, eviction before reuse.

A full GPU cache is the normal state of a busy vLLM worker: it evicts only when an allocation
needs room, so resident blocks sit at ``num_gpu_blocks`` hours on end. Pressure is eviction that
costs reuse, and three things measure it:

- **thrash**: of the GPU blocks a worker stored, the share it had itself evicted within the
  window (the same hash removed, then stored again on the same worker). A block stored again
  was wanted again: its eviction cost a recomputation.
- **eviction age**: how long an evicted block was resident (store to removal).
- **evicted before any reuse**: an evicted block for which no reuse was seen while it was
  resident. Reuse evidence, the only kinds the exporter can observe:
  a request record served on that worker counted it among its cached blocks
  (``block_hashes`` + ``cached_tokens``); vLLM announced it again while resident
  (``kv_cache_report_mode: full`` re-announces hit blocks); or two different blocks were stored
  on it as children (two requests branched from it). A block's first child is not evidence —
  the same request storing its next block names it as parent. Without records and in vLLM's
  default incremental mode, only branching is seen, so the share is an upper bound.

Memory is bounded per worker, never per block ever seen: recent evictions are a ring of at
most ``memory`` hashes (older than the window are dropped too), and store times are kept only
for a uniform sample of blocks (hash mod ``sample_every`` = 0; block hashes are uniformly
distributed), at most ``memory`` of them. Eviction age and reuse are measured on that sample.

Thrash is exact for blocks stored again within the last ``memory`` evictions. A worker whose
working set is larger than its cache stores blocks again long after that: a 100k-block cache
over a 170k-block working set stores each block again about 70k evictions after it evicted it,
17 times further back than a ring of 4096 reaches. So a second ring keeps a sample of the
evictions, 1 in the worker's *far sample* (a power of two), reaching ``memory`` × far sample
evictions back (the window still bounds both): a sampled block stored again from beyond the exact
ring stands for far-sample blocks of its age. The far sample is sized from the worker's capacity
(``size_for``: its ``num_gpu_blocks``) so that the ring reaches ``REACH_TURNOVERS`` cache-fulls of
evictions back — every re-store of a working set up to three times the cache is seen — and is
never below ``sample_every``; without a known capacity it is ``sample_every``. Its accuracy: the
estimate counts n = thrash × stored / far sample sampled re-stores in a window, so its relative
standard error is about 1/√n (block hashes are uniform): a 100k-block worker (far sample 64) that
stores 100k blocks in a window and thrashes at the 10 % line reads 0.10 ± 0.008. What the estimate
adds beyond a batch's stored blocks is carried to the worker's next stores, so restored never
exceeds stored.

Only GPU events count (``medium`` "GPU" or missing): offload tiers (CPU, disk) are other caches
whose stores and removals are copies, not evictions of the GPU cache.

Pure core: no I/O, no clock, no lock (``ClusterState`` calls it under its lock).

This module is the reference: the exporter runs ``exporter.core.index._prefix_core.CompiledEvictionTracker``
(the same rule in C, chosen with the prefix index in ``exporter.core.index.prefix_index``) when the extension
is built, and the equality tests hold the two to identical results.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

DEFAULT_MEMORY = 4096  # recent evictions (and sampled resident blocks) kept per worker
DEFAULT_SAMPLE_EVERY = 16  # store times kept for one block in this many (a power of two)
REACH_TURNOVERS = 2  # the sampled eviction ring reaches this many cache-fulls of evictions back
GPU = "GPU"


def far_sample(capacity: int | None, memory: int, sample_every: int) -> int:
    """The 1-in-n sample of a worker's eviction ring that reaches ``REACH_TURNOVERS`` cache-fulls
    back with ``memory`` entries: a power of two, at least ``sample_every``."""
    every = sample_every
    if capacity and capacity > 0:
        while every * memory < REACH_TURNOVERS * capacity:
            every *= 2
    return every


def is_gpu(medium: str | None) -> bool:
    """vLLM's GPU pool says "GPU"; before 0.11 there was no medium at all."""
    return medium is None or medium.upper() == GPU


@dataclass
class BatchEvictions:
    """What one batch did to a worker's GPU cache, for the eviction series."""

    stored: int = 0  # GPU blocks named by BlockStored
    restored: int = 0  # of those, evicted from this worker within the window before (see the module doc)
    evicted: int = 0  # GPU blocks named by BlockRemoved
    ages: list[tuple[float, bool]] = field(default_factory=list)  # sampled evictions: (age s, reused)
    other_media: bool = False  # the batch carried events of another medium (CPU, disk)


class _Worker:
    __slots__ = ("capacity", "carry", "far_every", "far_mask", "live", "recent", "sampled")

    def __init__(self, far_every: int) -> None:
        self.capacity: int | None = None  # the capacity the far sample was sized for
        self.far_every = far_every  # the sampled ring keeps 1 eviction in this many (a power of two)
        self.far_mask = far_every - 1
        self.carry = 0  # estimated restores not yet counted (a batch counts at most its stored blocks)
        self.recent: OrderedDict[int, float] = OrderedDict()  # evicted hash -> time, oldest first
        self.sampled: OrderedDict[int, float] = OrderedDict()  # the same for sampled hashes, reaching further
        # sampled resident block -> [stored at, first child or None, reuse seen]
        self.live: dict[int, list] = {}


class EvictionTracker:
    """Per-worker eviction lifecycle; ``apply`` once per KV batch, in each worker's order."""

    def __init__(self, window_s: float, memory: int = DEFAULT_MEMORY,
                 sample_every: int = DEFAULT_SAMPLE_EVERY) -> None:
        if memory < 1:
            raise ValueError("eviction memory must be at least 1")
        if sample_every < 1 or sample_every & (sample_every - 1):
            raise ValueError("sample_every must be a power of two")
        self.window_s = float(window_s)
        self.memory = memory
        self.sample_every = sample_every
        self._sample_mask = sample_every - 1
        self._workers: dict[str, _Worker] = {}

    def _worker(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker(self.sample_every)
        return w

    def size_for(self, worker: str, capacity: int | None) -> None:
        """Size the worker's sampled eviction ring for its capacity (``num_gpu_blocks``; None:
        unknown). A new size starts the ring afresh (its entries were sampled the old way)."""
        w = self._worker(worker)
        if capacity == w.capacity:
            return
        w.capacity = capacity
        every = far_sample(capacity, self.memory, self.sample_every)
        if every != w.far_every:
            w.far_every, w.far_mask = every, every - 1
            w.sampled.clear()

    def far_every(self, worker: str) -> int:
        """The worker's far sample (``sample_every`` until it is sized)."""
        w = self._workers.get(worker)
        return self.sample_every if w is None else w.far_every

    def apply(self, worker: str, events: Iterable[KvEvent], ts: float) -> BatchEvictions:
        w = self._worker(worker)
        out = BatchEvictions()
        for ev in events:
            if isinstance(ev, BlockStored):
                if is_gpu(ev.medium):
                    self._stored(w, ev, ts, out)
                else:
                    out.other_media = True
            elif isinstance(ev, BlockRemoved):
                if is_gpu(ev.medium):
                    self._removed(w, ev.hashes, ts, out)
                else:
                    out.other_media = True
            elif isinstance(ev, AllBlocksCleared):  # a reset, not eviction: nothing to learn from
                w.recent.clear()
                w.sampled.clear()
                w.carry = 0
                w.live.clear()
        self._expire(w, ts)
        return out

    def _stored(self, w: _Worker, ev: BlockStored, ts: float, out: BatchEvictions) -> None:
        hs = ev.hashes
        if not hs:
            return
        out.stored += len(hs)
        recent, sampled = w.recent, w.sampled
        restored = 0
        back: set[int] = set()
        if recent:
            back = recent.keys() & hs
            for h in back:
                if ts - recent.pop(h) <= self.window_s:
                    restored += 1
        mask = self._sample_mask
        picked = [h for h in hs if not h & mask]
        far = picked if w.far_mask == mask else [h for h in picked if not h & w.far_mask]
        if sampled and far:
            for h in sampled.keys() & far:
                at = sampled.pop(h)
                if ts - at <= self.window_s and h not in back:  # beyond the exact ring
                    restored += w.far_every
        restored += w.carry
        counted = min(restored, len(hs))
        w.carry = restored - counted
        out.restored += counted
        live = w.live
        for h in picked:
            rec = live.get(h)
            if rec is not None:
                rec[2] = True  # announced again while resident: vLLM's full report mode on a hit
            else:
                live[h] = [ts, None, False]
                if len(live) > self.memory:  # removals lost on the way leave entries behind
                    del live[next(iter(live))]
        if live:
            parents = (ev.parent, *hs[:-1])
            known = live.keys() & parents
            if known:
                for p, c in zip(parents, hs, strict=True):
                    if p in known:
                        rec = live[p]
                        if rec[1] is None:
                            rec[1] = c
                        elif rec[1] != c:
                            rec[2] = True  # a second, different child: two requests shared it

    def _removed(self, w: _Worker, hashes: Sequence[int], ts: float, out: BatchEvictions) -> None:
        out.evicted += len(hashes)
        recent, sampled, live = w.recent, w.sampled, w.live
        far_mask = w.far_mask
        for h in hashes:
            recent[h] = ts
            recent.move_to_end(h)
            if not h & far_mask:
                sampled[h] = ts
                sampled.move_to_end(h)
            rec = live.pop(h, None) if live else None
            if rec is not None:
                out.ages.append((max(0.0, ts - rec[0]), rec[2]))
        while len(recent) > self.memory:
            recent.popitem(last=False)
        while len(sampled) > self.memory:
            sampled.popitem(last=False)

    def _expire(self, w: _Worker, now: float) -> None:
        cutoff = now - self.window_s
        for ring in (w.recent, w.sampled):
            while ring:
                h, t = next(iter(ring.items()))
                if t >= cutoff:
                    break
                del ring[h]

    def hits(self, worker: str, hashes: Sequence[int]) -> None:
        """Blocks a request record says were served from this worker's cache: reuse seen."""
        w = self._workers.get(worker)
        if w is None or not w.live:
            return
        for h in w.live.keys() & hashes:
            w.live[h][2] = True

    def clear_worker(self, worker: str) -> None:
        """The worker's cache is gone (restart) or its view is rebuilt: forget its history."""
        self._workers.pop(worker, None)

    def tracked(self, worker: str) -> tuple[int, int]:
        """(recent evictions in the larger of the two rings, sampled resident blocks) held for the
        worker (memory checks: each is at most ``memory``)."""
        w = self._workers.get(worker)
        return (0, 0) if w is None else (max(len(w.recent), len(w.sampled)), len(w.live))
