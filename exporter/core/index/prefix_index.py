"""The cluster-wide prefix index, compiled when the extension was built, else the Python reference.

``exporter.core.index._prefix_core`` (Cython, built by ``pip install``) keeps blocks in flat C arrays with an
open-addressing hash table; ``exporter.core.index.prefix_index_ref`` is the plain-Python reference that
defines the semantics. Both have the same public interface and observable behaviour (the
equality tests apply random event streams to both). :data:`CORE` says which one is in use.
The same extension holds the per-worker eviction tracking (:data:`EvictionTracker`; the reference
is ``exporter.core.index.eviction``), chosen with the index. Both compiled classes also apply a batch read by
the compiled KV reader (``apply_scan``, straight from its C arrays; the equality tests hold it to
``apply`` on the batch's events).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from exporter.core.index.eviction import EvictionTracker as ReferenceEvictionTracker
from exporter.core.index.prefix_index_ref import (
    DEFAULT_MEDIUM,
    MAX_MEDIA,
    ROOT,
    ApplyResult,
    Match,
    ReferencePrefixIndex,
    TreeCopy,
    TreeStats,
)
from exporter.core.index.prefix_index_ref import compute_stats as _reference_stats

log = logging.getLogger("prefixscope.prefix_index")

__all__ = ["CORE", "DEFAULT_MEDIUM", "MAX_MEDIA", "ROOT", "ApplyResult", "EvictionTracker", "Match", "PrefixIndex",
           "ReferencePrefixIndex", "SliceTiming", "StatsPass", "TreeCopy", "TreeStats", "compute_stats", "pass_in_slices"]

# PREFIXSCOPE_INDEX=reference forces the Python index (to compare, or to rule the extension out).
_WANT = os.environ.get("PREFIXSCOPE_INDEX", "").strip().lower()

class StatsPass(Protocol):
    """What the compiled index's ``stats_pass`` returns (a ``StatsReading``): the statistics it
    keeps at apply time, depths included, read under the caller's lock by ``step`` until it
    returns True (one step unless depth shifts wait to be settled), then ``to_stats``."""

    version: int

    def step(self, max_blocks: int = ...) -> bool: ...

    def to_stats(self, keep_children_depth: int = 0) -> TreeStats: ...


# Both classes have ReferencePrefixIndex's interface (the compiled one is not a subclass).
PrefixIndex: type[ReferencePrefixIndex]
EvictionTracker: type[ReferenceEvictionTracker]
try:
    if _WANT == "reference":
        raise ImportError("PREFIXSCOPE_INDEX=reference")
    from exporter.core.index._prefix_core import CompiledEvictionTracker, CompiledPrefixIndex
except ImportError as exc:
    PrefixIndex = ReferencePrefixIndex
    EvictionTracker = ReferenceEvictionTracker
    CORE = "reference"
    (log.info if _WANT == "reference" else log.warning)(
        "prefix index: the Python reference implementation (compiled core not used: %s)", exc)
else:
    PrefixIndex = CompiledPrefixIndex  # type: ignore[assignment]
    EvictionTracker = CompiledEvictionTracker  # type: ignore[assignment]
    CORE = "compiled"


@dataclass(frozen=True)
class SliceTiming:
    """How a statistics reading held the index's lock: the longest hold (the ingest pause), all of them, how many."""

    max_hold_s: float
    total_s: float
    slices: int
    max_hold_cpu_s: float = 0.0  # the longest hold in this thread's CPU time (a loaded host's preemptions left out)


def pass_in_slices(index: ReferencePrefixIndex, lock: AbstractContextManager[object],
                   max_blocks: int = 0) -> tuple[TreeCopy | StatsPass, SliceTiming]:
    """A statistics reading of ``index``, stepped under ``lock`` one slice per hold (ingest runs between).

    The reference copies its dicts in one hold (C-level copies); the compiled index settles the
    depth shifts its ``apply`` left queued, a bounded number of blocks per hold (``max_blocks``;
    0: its default, a few milliseconds' worth), then copies the statistics it keeps at apply
    time in one hold (O(histogram + branching set)); nothing walks the tree.
    """
    holds: list[float] = []
    cpu = 0.0
    done = False
    tree: TreeCopy | StatsPass | None = None
    while not done:
        with lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            if tree is None:
                tree = index.stats_pass()
            done = tree.step(max_blocks)
            holds.append(time.perf_counter() - t0)
            cpu = max(cpu, time.thread_time() - c0)
    assert tree is not None
    return tree, SliceTiming(max(holds), sum(holds), len(holds), cpu)


def compute_stats(tree: TreeCopy | StatsPass, keep_children_depth: int = 0) -> TreeStats:
    """The statistics of a finished reading, keeping the top ``keep_children_depth`` edges.

    The reference runs its pass on its copy here; the compiled index only turns its counters
    into Python objects (its tree's top is a view of the live index).
    """
    if isinstance(tree, TreeCopy):
        return _reference_stats(tree, keep_children_depth)
    return tree.to_stats(keep_children_depth)
