"""What every router adapter shares: label folding, worker-name mapping and cumulative histograms.

Routers label a worker by the URL they route to; :func:`named` maps that URL to the configured
worker's name (``exporter.codecs.normalize.worker_names_by_url`` builds the mapping). Histograms are
kept as the router reports them — cumulative bucket counts on the router's own bounds, in
seconds or as ratios — and turned into observations by the state, scrape over scrape.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping

from exporter.codecs.promtext import ParseResult, Sample
from exporter.model import CumulativeHistogram


class UnrecognisedMetrics(ValueError):
    """The page parsed, but carries none of the names this normaliser knows."""


def by_label(samples: Iterable[Sample], label: str, rename: Mapping[str, str] | None = None) -> dict[str, float]:
    """Values summed per value of ``label`` (samples without it are left out)."""
    out: dict[str, float] = {}
    for s in samples:
        key = s.labels.get(label)
        if key is None:
            continue
        if rename is not None:
            key = rename.get(key, key)
        out[key] = out.get(key, 0.0) + s.value
    return out


def url_key(url: str) -> str:
    return url.strip().rstrip("/").lower()


def named(values: dict[str, float], names: Mapping[str, str] | None) -> dict[str, float]:
    """Router worker labels (URLs) → configured worker names; an unknown URL keeps its label."""
    if not names:
        return values
    out: dict[str, float] = {}
    for url, v in values.items():
        key = names.get(url_key(url), url)
        out[key] = out.get(key, 0.0) + v
    return out


def total(parsed: ParseResult, name: str) -> float | None:
    """Sum of a family over its label sets; None when the router did not report it."""
    got = parsed.samples.get(name)
    return sum(s.value for s in got) if got else None


def largest(parsed: ParseResult, names: Iterable[str]) -> float | None:
    """The largest sample of these families (each sample one tree); None when none was reported."""
    values = [s.value for n in names for s in parsed.samples.get(n, ())]
    return max(values) if values else None


def histogram_names(family: str) -> tuple[str, str, str]:
    return f"{family}_bucket", f"{family}_sum", f"{family}_count"


def histogram(parsed: ParseResult, family: str, scale: float = 1.0) -> CumulativeHistogram | None:
    """A histogram family summed over its label sets (all sets share the bounds, as in every
    router here); ``scale`` converts the unit (0.001 for a histogram in milliseconds).
    None when the family has no buckets, or its buckets are not cumulative."""
    bucket, sum_name, count_name = histogram_names(family)
    by_bound: dict[float, float] = {}
    for s in parsed.samples.get(bucket, ()):
        raw = s.labels.get("le")
        try:
            bound = float(raw) if raw is not None else math.nan
        except ValueError:
            return None
        if math.isnan(bound):
            return None
        by_bound[bound] = by_bound.get(bound, 0.0) + s.value
    if not by_bound or math.inf not in by_bound:
        return None
    bounds = tuple(sorted(by_bound))
    counts = tuple(by_bound[b] for b in bounds)
    if any(b < a for a, b in itertools.pairwise(counts)):
        return None
    scaled = tuple(b * scale if math.isfinite(b) else b for b in bounds)
    return CumulativeHistogram(scaled, counts, (total(parsed, sum_name) or 0.0) * scale,
                               total(parsed, count_name) or counts[-1])
