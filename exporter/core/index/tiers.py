"""Cache tiers: what each tier (the KV events' ``medium``) holds against its capacity, and what it
serves — the numbers behind "is offloading paying off".

A tier's capacity in blocks: the GPU's is the worker's capacity (``num_gpu_blocks`` or the
topology). An offload tier's is not published in blocks; vLLM's OffloadingConnector exports the
share of its CPU tier in use (``kv_offload_cpu_cache_usage_perc``) and announces the blocks it
holds there as KV events with medium ``CPU``, so capacity ≈ resident / used share. The estimate is
made only when the share is at least :data:`MIN_USAGE` (below, a few blocks more or less swing it
by far) and the tier holds blocks; otherwise the capacity is missing, never guessed.

What a tier serves: the engine's cached tokens by the tier that served them
(``prompt_tokens_cached_by_source``: ``device`` is the GPU, the others offload or transfer tiers)
and the KV connector's external hits (``external_prefix_cache_hits``, LMCache's hit tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

# The media KV events name (vLLM's ``medium``): the GPU pool and vLLM's offload tiers
# (``MEDIUM_CPU``, and ``MEDIUM_STORAGE`` for a disk tier), and a tier outside the worker.
GPU = "GPU"
CPU = "CPU"
STORAGE = "STORAGE"
EXTERNAL = "EXTERNAL"
MIN_USAGE = 0.05
DEVICE_TIER = "device"  # vLLM's and SGLang's name for the GPU tier among the served-by tiers


class _Resident(Protocol):
    @property
    def workers(self) -> list[str]: ...

    def resident_blocks(self, worker: str, medium: str | None = None) -> int | None: ...


def gpu_resident(index: _Resident) -> dict[str, int]:
    """worker -> blocks on its GPU tier: what the GPU's capacity (``num_gpu_blocks``) is compared
    with. Offload tiers (CPU, STORAGE, …) are other caches with other capacities; counted with
    the GPU's, a worker offloading 2,000 blocks beside 500 on a 1,000-block GPU read 250 % full."""
    return {w: index.resident_blocks(w, GPU) or 0 for w in index.workers}


def medium_capacity(gpu_capacity: int | None, usage: Mapping[str, float] | None,
                    resident: Mapping[str, int] | None) -> dict[str, float]:
    """medium -> capacity in blocks, for the tiers whose capacity is known or can be estimated."""
    out: dict[str, float] = {}
    if gpu_capacity:
        out[GPU] = float(gpu_capacity)
    for medium, share in (usage or {}).items():
        held = (resident or {}).get(medium)
        if held and share >= MIN_USAGE:
            out[medium] = round(held / share)
    return out


def offload_hit_tokens(tier_hits: Mapping[str, float] | None) -> float | None:
    """Cached tokens served by tiers other than the GPU (None when the engine names no tiers)."""
    if not tier_hits:
        return None
    return sum(v for tier, v in tier_hits.items() if tier != DEVICE_TIER)
