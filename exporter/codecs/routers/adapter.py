"""The shape of one router adapter: which names identify the router, which it reads, and how."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from exporter.codecs.promtext import ParseResult
from exporter.model import RouterSnapshot

Build = Callable[[str, ParseResult, Mapping[str, str] | None], RouterSnapshot]


@dataclass(frozen=True)
class RouterAdapter:
    """Maps one router's own series onto a :class:`RouterSnapshot`.

    ``prefixes`` identify the router on a page (``kind: auto``); ``names`` are the sample names
    it reads (histograms with their ``_bucket``/``_sum``/``_count``); ``counts`` must be finite
    and ≥ 0 and ``ratios`` lie in [0, 1] — a sample that breaks its rule drops its family from
    the scrape (``exporter.codecs.normalize.check_values``).
    """

    kind: str
    prefixes: tuple[str, ...]
    names: frozenset[str]
    counts: frozenset[str]
    ratios: frozenset[str]
    build: Build
    source: str  # where the names and label sets come from (for docs)
    # The router's default --max-tree-size (each prefix tree's bound), when it has a tree; the
    # config's ``routers[].max_tree_size`` overrides it.
    tree_bound: int | None = None

    def matches(self, names: Iterable[str]) -> bool:
        return any(n.startswith(self.prefixes) for n in names)
