"""Memory per resident block of the prefix index at a few million blocks.

The index is filled through its real ``apply`` path with chained ``BlockStored`` events from a
16-worker fleet: a shared system prompt, then 32-block branches with random 64-bit hashes,
a quarter of them also cached on a second worker. Memory is the process's RSS growth (what an
operator sees), measured after a garbage collection. The baseline, in the same run, is a bare
``set`` of the same block hashes — the least any hash-keyed index must hold.

The target is the index plus the tree statistics the background refresher holds between
readings (its latest one: depth and fan-out values, the kept runs of the tree's top), as RSS
growth once a reading's working memory is freed. Information rows: the index alone; the
process's peak while the next reading runs (Linux VmHWM, reset just before it), which is what
the host must have room for; the reading's longest hold of the state lock, which pauses ingest,
and all its holds together; building the result outside the lock; and the longest time another
thread could not run meanwhile (one long C-level call holds the GIL and stalls ingest just as
the lock does).

It measures the index in use (``exporter.core.index.prefix_index.CORE``; ``PREFIXSCOPE_INDEX=reference``
measures the Python reference). The compiled index keeps every statistic at apply time, leaf
depths included (its child links and packed depths are part of the index's bytes), and a
reading settles the depth shifts left queued, then copies its counters and histograms under
the lock (the pause row is the longest hold), no walk, no copy; the reference copies its dicts
in one hold and runs its pass outside the lock.
``bench.prefix_index`` compares the two per (worker, block) pair.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from typing import Any

from exporter.core.index.prefix_index import CORE, PrefixIndex, TreeStats, compute_stats, pass_in_slices
from exporter.core.state import TREE_CHILDREN_DEPTH
from exporter.model import BlockStored

BLOCKS = 3_000_000
WORKERS = 16
BRANCH = 32
DUPLICATED = 0.25  # share of branches also resident on a second worker
SHAPE_CHANGE = (1 << 64) - 1  # a block no fill stores: applied before the measured next reading
TARGET_BYTES = 60.0  # per resident block: the index plus the statistics held between readings (48 B a pair x 1.25)


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _grown(build: Any) -> tuple[int, Any]:
    gc.collect()
    before = rss_bytes()
    obj = build()
    gc.collect()
    return rss_bytes() - before, obj


def fill(index: PrefixIndex, blocks: int = BLOCKS, seed: int = 11) -> int:
    """Apply chained events for ``blocks`` distinct blocks; returns the resident (worker, block) count."""
    rng = random.Random(seed)
    system = tuple(rng.getrandbits(64) for _ in range(8))
    workers = [f"w{i}" for i in range(WORKERS)]
    for w in workers:
        index.apply(w, [BlockStored(system, None, 16)])
    made = len(system)
    while made < blocks:
        chain = tuple(rng.getrandbits(64) for _ in range(min(BRANCH, blocks - made)))
        made += len(chain)
        w = rng.randrange(WORKERS)
        ev = [BlockStored(chain, system[-1], 16)]
        index.apply(workers[w], ev)
        if rng.random() < DUPLICATED:
            index.apply(workers[(w + 1) % WORKERS], ev)
    return sum(index.resident_by_worker().values())


def hashes_only(blocks: int = BLOCKS, seed: int = 11) -> set[int]:
    """The same block hashes in a plain set (the baseline)."""
    rng = random.Random(seed)
    out = {rng.getrandbits(64) for _ in range(8)}
    made = len(out)
    while made < blocks:
        n = min(BRANCH, blocks - made)
        out.update(rng.getrandbits(64) for _ in range(n))
        made += n
        rng.randrange(WORKERS)
        rng.random()
    return out


def peak_rss_bytes() -> int | None:
    """The process's peak RSS since the last :func:`reset_peak` (Linux VmHWM), if readable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Restart the peak-RSS mark at the current RSS (Linux ``clear_refs`` 5); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class StallMeter:
    """A thread that wakes every millisecond and remembers the longest gap between wake-ups: how
    long the measured code kept every other thread (ingest) from running."""

    def __init__(self) -> None:
        self.longest_ms = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest_ms = max(self.longest_ms, (now - last) * 1000.0)
            last = now

    def __enter__(self) -> StallMeter:
        self._thread.start()
        time.sleep(0.01)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _timed_pass(index: PrefixIndex) -> tuple[TreeStats, float, float, float]:
    """One background statistics reading as the refresher runs it: (statistics, longest lock hold
    ms, all holds ms, building the result outside the lock ms)."""
    tree, held = pass_in_slices(index, threading.Lock())
    t1 = time.perf_counter()
    stats = compute_stats(tree, TREE_CHILDREN_DEPTH)
    return stats, held.max_hold_s * 1000.0, held.total_s * 1000.0, (time.perf_counter() - t1) * 1000.0


def _before_doubling(index: PrefixIndex, start: int) -> tuple[float, int] | None:
    """(RSS growth per resident block since ``start``, blocks) with the compiled index filled on
    with more branches to just below 3/4 of its table's slots: the hash table's share of memory
    is at its largest there (both the table and the next one, which doubling fills, resident).
    None for the reference index."""
    growth = getattr(index, "_growth", None)
    if growth is None:
        return None
    room = growth()["slots"] * 3 // 4 - len(index) - 4 * BRANCH
    if room > 0:
        fill(index, room, seed=12)
    gc.collect()
    return (rss_bytes() - start) / len(index), len(index)


def run() -> list[dict[str, Any]]:
    base_bytes, hashes = _grown(hashes_only)
    distinct = len(hashes)
    del hashes
    index = PrefixIndex()
    gc.collect()
    start = rss_bytes()
    index_bytes, resident = _grown(lambda: fill(index))
    assert len(index) == distinct, (len(index), distinct)
    # Between readings the refresher holds the latest statistics; a reading's working memory is
    # gone. That is the steady state an operator sees.
    held_bytes, (stats, hold_ms, holds_ms, build_ms) = _grown(lambda: _timed_pass(index))
    # The next reading runs while those are still held: its peak is the process's high-water mark.
    # One new block first, as a shape change between readings.
    index.apply("w0", [BlockStored((SHAPE_CHANGE,), None, 16)])
    gc.collect()
    before = rss_bytes()
    measured = reset_peak()
    with StallMeter() as stalls:
        _next, _hold_ms, _holds_ms, _build_ms = _timed_pass(index)
    peak = peak_rss_bytes() if measured else None
    del _next
    # A second worker caching blocks the tree holds: replicas change, the shape does not (with the
    # reference, a pass all the same).
    index.apply(f"w{WORKERS - 1}", [BlockStored((SHAPE_CHANGE,), None, 16)])
    _same, _same_hold_ms, same_holds_ms, _same_build_ms = _timed_pass(index)
    del _same
    runs = sum(map(len, stats.runs.values()))  # (read from the live index: before it is filled on)
    doubling = _before_doubling(index, start)
    base = base_bytes / distinct
    per_block = index_bytes / distinct
    with_stats = (index_bytes + held_bytes) / distinct
    peak_per_block = None if peak is None else (index_bytes + held_bytes + peak - before) / distinct
    return [
        {"name": f"prefix index ({CORE}) + held tree statistics, bytes per resident block ({distinct:,} blocks, "
                 f"{resident:,} worker copies; RSS between statistics readings)",
         "value": with_stats, "baseline": base, "ratio": with_stats / base,
         "target": f"<= {TARGET_BYTES:g} B", "ok": with_stats <= TARGET_BYTES},
        {"name": "... the prefix index alone",
         "value": per_block, "baseline": base, "ratio": per_block / base, "target": "information", "ok": True},
        {"name": "... peak during the next statistics reading (its working memory on top)",
         "value": peak_per_block, "baseline": base, "ratio": None if peak_per_block is None else peak_per_block / base,
         "target": "information", "ok": True},
        {"name": f"... the same filled on to {0 if doubling is None else doubling[1]:,} blocks, just before its hash "
                 "table doubles (the next table mapped and touched ahead: the most between two doublings; compiled "
                 "index only), B per resident block",
         "value": None if doubling is None else doubling[0], "baseline": base,
         "ratio": None if doubling is None else doubling[0] / base, "target": "information", "ok": True},
        {"name": f"tree-statistics reading, longest hold of the state lock = ingest pause ({distinct:,} blocks; ms)",
         "value": hold_ms, "baseline": None, "ratio": None, "target": "information", "ok": True},
        {"name": "... all its holds together (queued depth shifts settled, statistics copied; ms)",
         "value": holds_ms, "baseline": None, "ratio": None, "target": "information", "ok": True},
        {"name": "... the same reading when only holders changed (shape kept), all its holds (ms)",
         "value": same_holds_ms, "baseline": None, "ratio": None, "target": "information", "ok": True},
        {"name": "... building the result outside the lock (ms)",
         "value": build_ms, "baseline": None, "ratio": None, "target": "information", "ok": True},
        {"name": "... longest stall of another thread during the reading (GIL held by one C call; ms)",
         "value": stalls.longest_ms, "baseline": None, "ratio": None, "target": "information", "ok": True},
        {"name": f"... runs kept for the API's top {TREE_CHILDREN_DEPTH} radix edges (blocks in them)",
         "value": runs, "baseline": None, "ratio": None,
         "target": "information", "ok": True},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
