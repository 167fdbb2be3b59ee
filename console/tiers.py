"""Is offloading paying off? Per worker: what the offload tiers hold against what they serve.

Read from the exporter's /api/v1/workers rows (``resident_blocks_by_medium``,
``capacity_blocks_by_medium``, ``hit_tokens_by_tier`` and the external connector's queried and
hit tokens, in the exporter's window). Plain data in, plain rows out, so the page stays thin and
the judgement is tested directly.

"Served by offload": cached tokens of tiers other than the GPU (``device``) where the engine
names tiers (vLLM ≥ 0.33, SGLang); else the KV connector's external hits (vLLM's
external_prefix_cache_hits, LMCache's hit tokens). A worker that reports neither has hits that
are unknown, never zero.

LMCache, where it is the engine's KV connector, says more of itself: the share of the tokens it
was asked to look up that it held, and how long its retrieves (loads into the GPU), stores and
lookups take (``lmcache_*`` of the rows). A worker without LMCache has these missing, never zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GPU = "GPU"
DEVICE = "device"
PAYING_SHARE = 0.10  # an offload tier serving at least this share of the cached tokens earns its memory


@dataclass(frozen=True)
class Verdict:
    kind: str  # "paying", "marginal", "idle", "unknown", "none"
    text: str


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _offload(by_medium: Any) -> float | None:
    if not isinstance(by_medium, Mapping):
        return None
    values = [_num(v) for m, v in by_medium.items() if m != GPU]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def offload_row(w: Mapping[str, Any], window_s: float) -> dict[str, Any]:
    """One worker's offload numbers and verdict."""
    held = _offload(w.get("resident_blocks_by_medium"))
    capacity = _offload(w.get("capacity_blocks_by_medium"))
    tiers = w.get("hit_tokens_by_tier") if isinstance(w.get("hit_tokens_by_tier"), Mapping) else None
    ext_q, ext_h = _num(w.get("external_queried_tokens")), _num(w.get("external_hit_tokens"))
    if tiers:
        served = sum(_num(v) or 0.0 for t, v in tiers.items() if t != DEVICE)
        cached = sum(_num(v) or 0.0 for v in tiers.values())
    else:
        served, cached = ext_h, None
    share = served / cached if served is not None and cached else None
    per_1k = served / window_s / (held / 1000) if served is not None and held and window_s > 0 else None
    lookups, held_tokens = _num(w.get("lmcache_lookup_queried_tokens")), _num(w.get("lmcache_lookup_hit_tokens"))
    p50, p99 = _times(w.get("lmcache_seconds_p50")), _times(w.get("lmcache_seconds_p99"))
    return {"worker": w.get("worker"), "offload_blocks": held, "offload_capacity_blocks": capacity,
            "offload_fill": held / capacity if held is not None and capacity else None,
            "offload_hit_tokens": served, "offload_share_of_cached": share,
            "external_hit_ratio": ext_h / ext_q if ext_h is not None and ext_q else None,
            "hit_tokens_per_s_per_1k_blocks": per_1k,
            "lmcache_lookup_hit_ratio": held_tokens / lookups if held_tokens is not None and lookups else None,
            "lmcache_retrieve_p50_s": p50.get("retrieve"), "lmcache_retrieve_p99_s": p99.get("retrieve"),
            "lmcache_store_p99_s": p99.get("store"), "lmcache_lookup_p99_s": p99.get("lookup"),
            "verdict": verdict(held, served, share).text}


def _times(by_operation: Any) -> dict[str, float]:
    """LMCache's time per operation (the exporter's ``lmcache_seconds_p50``/``_p99``), numbers only."""
    if not isinstance(by_operation, Mapping):
        return {}
    return {op: v for op, raw in by_operation.items() if (v := _num(raw)) is not None}


def verdict(held: float | None, served: float | None, share: float | None) -> Verdict:
    if not held and served is None:
        return Verdict("none", "no offload tier reported")
    if served is None:
        return Verdict("unknown", "holds blocks; what it serves is not reported (needs vLLM's "
                                  "prompt_tokens_cached_by_source or external prefix-cache counters)")
    if served == 0:
        return Verdict("idle", "serves nothing in the window: not paying off" if held
                       else "serves nothing in the window")
    if share is None:
        return Verdict("paying", "serves external hits (no per-tier split to compare with the GPU)")
    if share >= PAYING_SHARE:
        return Verdict("paying", f"paying off: {share:.0%} of cached tokens come from offload")
    return Verdict("marginal", f"marginal: {share:.1%} of cached tokens come from offload")


def offload_rows(workers: Sequence[Mapping[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """Rows for the workers that report anything about offloading (the rest are left out)."""
    rows = [offload_row(w, window_s) for w in workers]
    return [r for r in rows if r["offload_blocks"] or r["offload_hit_tokens"] is not None
            or any(r[k] is not None for k in LMCACHE_COLUMNS)]


# The row's LMCache columns (None where the worker runs without LMCache)
LMCACHE_COLUMNS = ("lmcache_lookup_hit_ratio", "lmcache_retrieve_p50_s", "lmcache_retrieve_p99_s",
                   "lmcache_store_p99_s", "lmcache_lookup_p99_s")


def cluster_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Blocks held and tokens served by the offload tiers over the workers shown."""
    held = [r["offload_blocks"] for r in rows if r["offload_blocks"] is not None]
    served = [r["offload_hit_tokens"] for r in rows if r["offload_hit_tokens"] is not None]
    return {"offload_blocks": sum(held) if held else None, "offload_hit_tokens": sum(served) if served else None}
