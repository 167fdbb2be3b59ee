"""Router adapters: each maps one router's own /metrics series onto a :class:`RouterSnapshot`.

One module per router — :mod:`.sglang` (SGLang gateway / sglang-router), :mod:`.vllm_router`,
:mod:`.dynamo` (Dynamo's KV router), :mod:`.llmd` (llm-d's scheduler and indexer). ``kind: auto``
picks the adapter whose name prefixes appear on the page (the first in :data:`ADAPTERS` order).
What a snapshot carries feeds the catalogue: decisions per worker, prefix hit/miss outcomes,
worker health, the predicted-reuse distribution and the prefix-lookup latency (the
``walk_latency`` signal of ``prefix_tree_walk_latency``).
"""

from __future__ import annotations

from collections.abc import Iterable

from exporter.codecs.routers import dynamo, llmd, sglang, vllm_router
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import UnrecognisedMetrics

ADAPTERS: tuple[RouterAdapter, ...] = (sglang.ADAPTER, vllm_router.ADAPTER, dynamo.ADAPTER, llmd.ADAPTER)
BY_KIND: dict[str, RouterAdapter] = {a.kind: a for a in ADAPTERS}
KINDS: tuple[str, ...] = ("auto", *BY_KIND)
NAMES: frozenset[str] = frozenset().union(*(a.names for a in ADAPTERS))


def detect(names: Iterable[str]) -> RouterAdapter | None:
    """The adapter whose names appear among ``names`` (None if no router's do)."""
    seen = list(names)
    return next((a for a in ADAPTERS if a.matches(seen)), None)


def adapter_for(kind: str, names: Iterable[str]) -> RouterAdapter:
    """The configured adapter, or for ``auto`` the detected one; UnrecognisedMetrics if none fits."""
    if kind != "auto":
        try:
            return BY_KIND[kind]
        except KeyError:
            raise ValueError(f"unknown router kind {kind!r}; choose one of {', '.join(KINDS)}") from None
    found = detect(names)
    if found is None:
        raise UnrecognisedMetrics(f"no metric of a known router ({', '.join(BY_KIND)})")
    return found


__all__ = ["ADAPTERS", "BY_KIND", "KINDS", "NAMES", "RouterAdapter", "UnrecognisedMetrics", "adapter_for", "detect"]
