"""The compiled prefix index against the Python reference, in the same run.

Three measurements, each run on both implementations (the reference is the baseline; the
ratio is compiled / reference):

* apply: block events per second for batches of ``BlockStored`` chains and per-block
  ``BlockRemoved`` events (vLLM sends one removal per evicted block) in a steady state where
  every worker evicts its oldest chain as it stores a new one;
* memory: RSS growth per resident (worker, block) pair at 5 M pairs, the index plus the tree
  statistics held between readings (the fill of ``bench.memory``: 16 workers, shared system
  prompt, 32-block branches, a quarter on a second worker); the peak during a reading is shown too;
* available: ``longest_match`` latency (p99 over single calls, wall clock, the median of three
  runs over the same 5,000 chains) at 1,000 workers and
  3 M blocks for chains of the system prompt (on every worker), part of a branch and a miss
  tail; the compiled result builds its per-worker dict on first use, so the row with that dict
  is shown as information, as is the p99 in thread CPU time (thread_time costs ~1-2 µs a read);
* available per record: what the record path asks of a match — the longest match, the depth on
  the serving worker and the best depth on the others (``depth_on``/``best_depth``) — against the
  same answers read from the per-worker dict (the baseline), same index and chains;
* statistics pause: the longest hold of the state lock while the refresher reads the statistics
  at 10 M (worker, block) pairs — everything is kept at apply time, so a reading settles the
  depth shifts left queued and copies the counters and histograms, O(histogram) — with another
  thread applying KV batches meanwhile, against one walk of every entry of the tree (baseline:
  what a reading cost when it walked the tree for the depths);
* worst-case subtree shift: at the same 10 M pairs, a second child at the 4th block of the system
  prompt every block hangs under (all of them gain an edge) and its removal (they lose it again):
  the ``apply`` itself, then the next reading that settles the shift in steps (all its holds, the
  longest one), against the same walk of every entry.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.memory import SHAPE_CHANGE, StallMeter, fill, peak_rss_bytes, reset_peak, rss_bytes
from exporter.core.index.prefix_index import ReferencePrefixIndex, compute_stats, pass_in_slices
from exporter.model import BlockRemoved, BlockStored, KvEvent

try:
    from exporter.core.index._prefix_core import CompiledPrefixIndex
except ImportError:  # no compiled core in this install: only the reference rows
    CompiledPrefixIndex = None

APPLY_TARGET = 2_000_000  # block events per second, one core
BYTES_TARGET = 48.0  # per (worker, block) pair with statistics
LOOKUP_TARGET_US = 20.0  # p99 of one available lookup
MEMORY_BLOCKS = 4_000_000  # x 1.25 copies -> ~5 M pairs
LOOKUP_WORKERS = 1000
LOOKUP_BLOCKS = 3_000_000
KEEP = 4  # the refresher's kept top of the tree (exporter.core.state.TREE_CHILDREN_DEPTH)
PAUSE_TARGET_MS = 10.0  # longest state-lock hold of one statistics refresh
PAUSE_BLOCKS = 8_000_000  # x 1.25 copies -> ~10 M pairs
SPLIT = (1 << 64) - 2  # a block no fill stores: the second child of the system prompt's 4th block

Factory = Callable[[], Any]


def _stream(workers: int = 64, steps: int = 20_000, chain: int = 16, keep: int = 8,
            seed: int = 3) -> tuple[list[tuple[str, list[KvEvent]]], int]:
    """Batches of (worker, events) and the block events in them."""
    rng = random.Random(seed)
    system = tuple(rng.getrandbits(64) for _ in range(8))
    names = [f"w{i}" for i in range(workers)]
    held: dict[str, list[tuple[int, ...]]] = {w: [] for w in names}
    batches: list[tuple[str, list[KvEvent]]] = [(w, [BlockStored(system, None, 16)]) for w in names]
    blocks = len(system) * workers
    for step in range(steps):
        w = names[step % workers]
        hs = tuple(rng.getrandbits(64) for _ in range(chain))
        events: list[KvEvent] = [BlockStored(hs, system[-1], 16)]
        held[w].append(hs)
        if len(held[w]) > keep:
            events += [BlockRemoved((h,)) for h in held[w].pop(0)]
            blocks += chain
        blocks += chain
        batches.append((w, events))
    return batches, blocks


def _apply_rate(factory: Factory, batches: list[tuple[str, list[KvEvent]]], blocks: int) -> float:
    best = float("inf")
    for _ in range(3):  # best of three: other processes share the two cores
        index = factory()
        apply = index.apply
        gc.collect()
        t0 = time.perf_counter()
        for w, events in batches:
            apply(w, events)
        best = min(best, time.perf_counter() - t0)
    return blocks / best


def _memory(factory: Factory) -> tuple[float, float | None, int, float]:
    """(bytes per pair with held statistics, peak bytes per pair during a pass, pairs, pass ms)."""
    gc.collect()
    before = rss_bytes()
    index = factory()
    pairs = fill(index, MEMORY_BLOCKS)
    stats = index.stats(KEEP)
    gc.collect()
    held = rss_bytes() - before
    index.apply("w0", [BlockStored((SHAPE_CHANGE,), None, 16)])  # unchanged, the tree would reuse the walk
    measured = reset_peak()
    now = rss_bytes()
    t0 = time.perf_counter()
    with StallMeter():
        again = index.stats(KEEP)
    pass_ms = (time.perf_counter() - t0) * 1000.0
    peak = peak_rss_bytes() if measured else None
    del again, stats, index
    gc.collect()
    return held / pairs, None if peak is None else (held + peak - now) / pairs, pairs, pass_ms


def _lookup_index(factory: Factory, seed: int = 5) -> tuple[Any, list[tuple[int, ...]]]:
    rng = random.Random(seed)
    index = factory()
    system = tuple(rng.getrandbits(64) for _ in range(8))
    workers = [f"w{i}" for i in range(LOOKUP_WORKERS)]
    for w in workers:
        index.apply(w, [BlockStored(system, None, 16)])
    branches: list[tuple[int, ...]] = []
    made = len(system)
    while made < LOOKUP_BLOCKS:
        hs = tuple(rng.getrandbits(64) for _ in range(32))
        made += len(hs)
        w = rng.randrange(LOOKUP_WORKERS)
        ev = [BlockStored(hs, system[-1], 16)]
        index.apply(workers[w], ev)
        if rng.random() < 0.25:
            index.apply(workers[(w + 1) % LOOKUP_WORKERS], ev)
        branches.append(hs)
    chains = []
    for _ in range(5000):
        b = rng.choice(branches)
        chains.append(system + b[:rng.randint(0, 32)] + tuple(rng.getrandbits(64) for _ in range(4)))
    return index, chains


def _p99_us(fn: Callable[[tuple[int, ...]], Any], chains: list[tuple[int, ...]],
            clock: Callable[[], int] = time.perf_counter_ns) -> float:
    times = []
    for c in chains:
        t0 = clock()
        fn(c)
        times.append(clock() - t0)
    times.sort()
    return times[int(len(times) * 0.99)] / 1000.0


def _lookups(factory: Factory) -> tuple[float, float, float]:
    """p99 µs of longest_match (wall clock; this thread's CPU time), and with its per-worker dict."""
    index, chains = _lookup_index(factory)
    gc.collect()
    match = index.longest_match
    _p99_us(match, chains[:500])  # warm

    def median3(fn: Callable[[], float]) -> float:  # a burst of load on the shared host skews one run
        return sorted(fn() for _ in range(3))[1]

    bare = median3(lambda: _p99_us(match, chains))
    cpu = median3(lambda: _p99_us(match, chains, time.thread_time_ns))  # without other processes' turns
    with_dict = _p99_us(lambda c: match(c).per_worker, chains)
    return bare, cpu, with_dict


def _record_lookups(factory: Factory) -> tuple[float, float]:
    """p99 µs of the record path's questions: via the match's accessors, and via its per-worker dict."""
    index, chains = _lookup_index(factory)
    gc.collect()
    match = index.longest_match
    names = [f"w{i}" for i in range(LOOKUP_WORKERS)]
    rng = random.Random(9)
    asks = [(c, names[rng.randrange(LOOKUP_WORKERS)]) for c in chains]
    it = iter(asks)

    def accessors(c: tuple[int, ...]) -> tuple[int, int]:
        _, w = next(it)
        m = match(c)
        return m.depth_on(w), m.best_depth({w})

    def from_dict(c: tuple[int, ...]) -> tuple[int, int]:
        _, w = next(it)
        per = match(c).per_worker
        return per.get(w, 0), max((d for x, d in per.items() if x != w), default=0)

    def p99(fn: Callable[[tuple[int, ...]], Any]) -> float:
        nonlocal it
        runs = []
        for _ in range(3):
            it = iter(asks)
            runs.append(_p99_us(fn, [c for c, _w in asks]))
        return sorted(runs)[1]

    return p99(accessors), p99(from_dict)


def _reading_ms(index: Any, lock: threading.Lock) -> tuple[float, float, int]:
    """(longest hold in CPU ms, all holds in wall-clock ms, steps) of one statistics reading."""
    tree, held = pass_in_slices(index, lock)
    compute_stats(tree, KEEP)
    return held.max_hold_cpu_s * 1000.0, held.total_s * 1000.0, held.slices


def _stats_pause(factory: Factory) -> dict[str, Any]:
    """The statistics pause with ingest running, and the worst-case subtree shift, at 10 M pairs."""
    index = factory()
    pairs = fill(index, PAUSE_BLOCKS)
    system = tuple(random.Random(11).getrandbits(64) for _ in range(8))  # fill's system prompt (same seed)
    lock = threading.Lock()
    stop = threading.Event()
    rng = random.Random(13)

    def ingest() -> None:  # KV batches between the slices: new chains, and their removal
        while not stop.is_set():
            hs = tuple(rng.getrandbits(64) for _ in range(16))
            with lock:
                index.apply("w0", [BlockStored(hs, None, 16)])
            with lock:
                index.apply("w0", [BlockRemoved(hs[8:])])
            time.sleep(0.0005)

    gc.collect()
    t = threading.Thread(target=ingest, daemon=True)
    t.start()
    try:
        tree, held = pass_in_slices(index, lock)
        compute_stats(tree, KEEP)
    finally:
        stop.set()
        t.join()
    del tree
    gc.collect()
    t0 = time.perf_counter()  # the baseline: one walk of every entry (every depth recomputed from the roots)
    index._rebuild_depths()
    walk_ms = (time.perf_counter() - t0) * 1000.0
    out: dict[str, Any] = {"pause": held.max_hold_cpu_s * 1000.0, "wall": held.max_hold_s * 1000.0,
                           "steps": held.slices, "walk": walk_ms, "pairs": pairs}
    for name, events in (("split", [BlockStored((SPLIT,), system[3], 16)]), ("merge", [BlockRemoved((SPLIT,))])):
        t0 = time.perf_counter()
        index.apply("w0", events)
        out[f"{name}_apply"] = (time.perf_counter() - t0) * 1000.0
        out[f"{name}_hold"], out[f"{name}_total"], out[f"{name}_steps"] = _reading_ms(index, lock)
    return out


def _row(name: str, comp: float | None, ref: float, target: str, ok: bool | None) -> dict[str, Any]:
    return {"name": name, "value": comp, "baseline": ref,
            "ratio": None if comp is None or not ref else comp / ref, "target": target,
            "ok": bool(ok) if comp is not None else False}


def run() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    comp = CompiledPrefixIndex
    batches, blocks = _stream()
    ref_rate = _apply_rate(ReferencePrefixIndex, batches, blocks)
    c_rate = _apply_rate(comp, batches, blocks) if comp else None
    rows.append(_row(f"prefix index apply, block events/s (compiled vs reference; {blocks:,} events, 64 workers)",
                     c_rate, ref_rate, f">= {APPLY_TARGET:,}", c_rate is not None and c_rate >= APPLY_TARGET))
    del batches
    # Compiled first: its arrays come fresh from the OS, not from memory the reference's run freed.
    c_b, c_peak, _pairs, c_ms = _memory(comp) if comp else (None, None, 0, None)
    ref_b, ref_peak, pairs, ref_ms = _memory(ReferencePrefixIndex)
    rows.append(_row(f"prefix index + held tree statistics, RSS bytes per (worker, block) pair ({pairs:,} pairs)",
                     c_b, ref_b, f"<= {BYTES_TARGET:g} B", c_b is not None and c_b <= BYTES_TARGET))
    rows.append(_row("... peak per pair while the next statistics reading runs", c_peak, ref_peak or 0.0,
                     "information", True))
    rows.append(_row("... statistics reading, kept statistics (compiled) vs copy + pass (reference; ms)",
                     c_ms, ref_ms, "information", True))
    ref_p99, ref_cpu, ref_dict = _lookups(ReferencePrefixIndex)
    c_p99, c_cpu, c_dict = _lookups(comp) if comp else (None, None, None)
    rows.append(_row(f"available lookup p99 µs ({LOOKUP_WORKERS:,} workers, {LOOKUP_BLOCKS:,} blocks)",
                     c_p99, ref_p99, f"<= {LOOKUP_TARGET_US:g} µs", c_p99 is not None and c_p99 <= LOOKUP_TARGET_US))
    rows.append(_row("... the same, this thread's CPU time (a loaded host's preemptions left out)",
                     c_cpu, ref_cpu, "information", True))
    rows.append(_row("... with the per-worker depth dict built", c_dict, ref_dict, "information", True))
    if comp:
        acc, via_dict = _record_lookups(comp)
        rows.append(_row(f"available per record p99 µs: depth on the worker + best elsewhere, accessors vs "
                         f"per-worker dict ({LOOKUP_WORKERS:,} workers, {LOOKUP_BLOCKS:,} blocks)",
                         acc, via_dict, f"<= {LOOKUP_TARGET_US:g} µs", acc <= LOOKUP_TARGET_US))
        p = _stats_pause(comp)
        walk = p["walk"]
        rows.append(_row(f"statistics pause: longest state-lock hold in CPU time of a reading, statistics kept at "
                         f"apply time, {p['steps']} step(s) (ingest running) vs one walk of every entry "
                         f"({p['pairs']:,} pairs; ms)",
                         p["pause"], walk, f"<= {PAUSE_TARGET_MS:g} ms", p["pause"] <= PAUSE_TARGET_MS))
        rows.append(_row("... the same hold in wall-clock time (a loaded host preempts the holder)", p["wall"], walk,
                         "information", True))
        for name, what in (("split", "a second child at the prompt's 4th block: every block below gains an edge"),
                           ("merge", "its removal: every block below loses the edge again")):
            rows.append(_row(f"worst-case subtree shift, {what}: its apply (ms) vs one walk of every entry",
                             p[f"{name}_apply"], walk, "information", True))
            rows.append(_row(f"... settled by the next reading: longest hold in CPU time, {p[name + '_steps']} "
                             f"steps (ms) vs the walk", p[f"{name}_hold"], walk, f"<= {PAUSE_TARGET_MS:g} ms",
                             p[f"{name}_hold"] <= PAUSE_TARGET_MS))
            rows.append(_row("... all its holds, wall clock (ms) vs the walk", p[f"{name}_total"], walk,
                             "information", True))
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
