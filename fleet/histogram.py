"""Bucket counts on fixed bounds, as a Prometheus client keeps them (``value <= bound``)."""

from __future__ import annotations

import math
from bisect import bisect_left


class Histogram:
    """Cumulative-ready bucket counts on fixed bounds, sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound ≥ value
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, run = [], 0
        for bound, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            run += c
            out.append((bound, run))
        return out

    def copy(self) -> Histogram:
        h = Histogram(self.bounds)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h
