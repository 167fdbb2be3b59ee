"""Sampled KV-block residency on the simulated clock, as vLLM ≥ 0.14 measures it with
``--kv-cache-metrics`` (vllm/v1/core/kv_cache_metrics.py, KVCacheMetricsCollector).

A newly cached block is sampled with probability ``sample_rate`` (``--kv-cache-metrics-sample``,
0.01 by default). A sampled block remembers when it was allocated, when it was last accessed (a
prefix-cache hit that takes it; its allocation counts as the first) and its four latest hits.
When the cache evicts it, three histograms are observed on vLLM's ``kv_cache_residency`` bounds:
its lifetime (allocation to eviction), its idle time (last access to eviction: the time a running
request held it counts, as in vLLM, where an access is the hit and not the release) and the gaps
between its recorded hits (none for a block hit less than twice). A cache reset forgets every
sampled block without an observation. Blocks never evicted are never observed, so a cache with
room reports nothing: vLLM evicts only on demand.

Sampling is drawn from the worker's own seeded generator, so a run is reproducible and the
sampler's cost is one dictionary lookup per hit block (and none while the flag is off: no sampler).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from itertools import pairwise

from fleet.histogram import Histogram

# vLLM's kv_cache_residency bucket family (vllm/v1/metrics/loggers.py, 0.14.0)
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
                     120.0, 300.0, 600.0, 1200.0, 1800.0)
DEFAULT_SAMPLE_RATE = 0.01  # --kv-cache-metrics-sample
ACCESS_HISTORY = 4  # the hits a sampled block remembers (vLLM's ring buffer)


@dataclass(slots=True)
class _Sampled:
    born: float
    last_access: float
    hits: deque


@dataclass(slots=True)
class Residency:
    """The three histograms, as /metrics renders them."""

    lifetime: Histogram
    idle_before_evict: Histogram
    reuse_gap: Histogram

    @classmethod
    def empty(cls) -> Residency:
        return cls(Histogram(RESIDENCY_BUCKETS), Histogram(RESIDENCY_BUCKETS), Histogram(RESIDENCY_BUCKETS))

    def copy(self) -> Residency:
        return Residency(self.lifetime.copy(), self.idle_before_evict.copy(), self.reuse_gap.copy())


class ResidencySampler:
    """Follows a sample of one cache's blocks; not thread-safe (the cache's owner locks)."""

    def __init__(self, sample_rate: float = DEFAULT_SAMPLE_RATE, seed: int | str = 0) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._rng = random.Random(f"kv-cache-metrics:{seed}")
        self._blocks: dict[int, _Sampled] = {}
        self.histograms = Residency.empty()

    @property
    def tracked(self) -> int:
        """Sampled blocks still resident."""
        return len(self._blocks)

    def allocated(self, h: int, at: float) -> None:
        if self._rng.random() < self.sample_rate:
            self._blocks[h] = _Sampled(at, at, deque(maxlen=ACCESS_HISTORY))

    def accessed(self, h: int, at: float) -> None:
        b = self._blocks.get(h)
        if b is not None:
            b.last_access = at
            b.hits.append(at)

    def evicted(self, h: int, at: float) -> None:
        b = self._blocks.pop(h, None)
        if b is None:
            return
        hs = self.histograms
        hs.lifetime.observe(max(0.0, at - b.born))
        hs.idle_before_evict.observe(max(0.0, at - b.last_access))
        for earlier, later in pairwise(b.hits):
            hs.reuse_gap.observe(max(0.0, later - earlier))

    def reset(self) -> None:
        self._blocks.clear()
