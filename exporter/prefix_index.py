"""The cluster-wide prefix index, compiled when the extension was built, else the Python reference.

``exporter._prefix_core`` (Cython, built by ``pip install``) keeps blocks in flat C arrays with an
open-addressing hash table; ``exporter.prefix_index_ref`` is the plain-Python reference that
defines the semantics. Both have the same public interface and observable behaviour (the
equality tests apply random event streams to both). :data:`CORE` says which one is in use.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from exporter.prefix_index_ref import (
    DEFAULT_MEDIUM,
    MAX_MEDIA,
    ROOT,
    ApplyResult,
    Match,
    ReferencePrefixIndex,
    TreeCopy,
    TreeStats,
)
from exporter.prefix_index_ref import compute_stats as _reference_stats

log = logging.getLogger("prefixscope.prefix_index")

__all__ = ["CORE", "DEFAULT_MEDIUM", "MAX_MEDIA", "ROOT", "ApplyResult", "Match", "PrefixIndex",
           "ReferencePrefixIndex", "StatsPass", "TreeCopy", "TreeStats", "compute_stats"]

# PREFIXSCOPE_INDEX=reference forces the Python index (to compare, or to rule the extension out).
_WANT = os.environ.get("PREFIXSCOPE_INDEX", "").strip().lower()

class StatsPass(Protocol):
    """What the compiled index's ``copy_for_stats`` returns: a finished pass awaiting its kept top."""

    version: int

    def to_stats(self, keep_children_depth: int = 0) -> TreeStats: ...


# Both classes have ReferencePrefixIndex's interface (the compiled one is not a subclass).
PrefixIndex: type[ReferencePrefixIndex]
try:
    if _WANT == "reference":
        raise ImportError("PREFIXSCOPE_INDEX=reference")
    from exporter._prefix_core import CompiledPrefixIndex
except ImportError as exc:
    PrefixIndex = ReferencePrefixIndex
    CORE = "reference"
    (log.info if _WANT == "reference" else log.warning)(
        "prefix index: the Python reference implementation (compiled core not used: %s)", exc)
else:
    PrefixIndex = CompiledPrefixIndex  # type: ignore[assignment]
    CORE = "compiled"


def compute_stats(tree: TreeCopy | StatsPass, keep_children_depth: int = 0) -> TreeStats:
    """The statistics of what ``copy_for_stats`` returned, keeping the top ``keep_children_depth`` edges.

    The reference copies the tree and walks it here; the compiled index ran its pass in C when
    the copy was asked for and only the kept top of the tree is filtered here.
    """
    if isinstance(tree, TreeCopy):
        return _reference_stats(tree, keep_children_depth)
    return tree.to_stats(keep_children_depth)
