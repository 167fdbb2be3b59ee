"""Tenants on LoRA adapters and cache salts through small simulated engines: the workload the
attribution tests drive, and what the engines' caches then hold per adapter and tenant."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable

from exporter.core.attribution import NONE
from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, SimEngine, WorkerSpec
from fleet.router import import_prefix
from fleet.workloads import WorkloadGenerator, WorkloadParams

TENANTS = {"tenants": 4, "tenant_loras": ("billing-v2", None, "billing-v2", "travel-v1"),
           "tenant_salts": ("acme", "globex", None, "hooli"), "fork_prob": 0.3, "chat_sessions_per_s": 1.0,
           "system_tokens": 800, "tool_tokens": 200, "cold_prompt_tokens": (1000, 2000), "doc_tokens": (2000, 4000),
           "docqa_tokens": (1000, 2000), "extract_tokens": (2000, 3000), "doc_per_s": 0.05}

# worker name -> the engine's KV-event callback (events, ts)
EventsSink = Callable[[str], Callable[[list, float], None]]


def drive(sink: EventsSink, workers: int = 2, blocks: int = 900, seed: int = 5) -> list[SimEngine]:
    """Two minutes of the tenants' workload over ``workers`` engines of ``blocks`` GPU blocks
    (evictions included), each engine's KV events handed to ``sink(name)``; the system prompts
    pre-warmed on every engine, as operators do."""
    clock = VirtualClock()
    engines = [SimEngine(WorkerSpec(f"w{i}", num_gpu_blocks=blocks), clock, sink(f"w{i}")) for i in range(workers)]
    gen = WorkloadGenerator([(0.0, WorkloadParams().with_overrides(TENANTS))], 120, seed=seed)
    for eng in engines:
        for i, shared in enumerate(gen.shared_prompts()):
            import_prefix(eng, f"prewarm-{i}", shared.block_hashes, shared.token_ids, shared.lora_name,
                          shared.lora_id, shared.cache_salt)
    for r in gen.requests():
        eng = engines[zlib.crc32(r.conversation.encode()) % workers]
        res = eng.execute(EngineRequest(r.request_id, token_ids=r.token_ids, block_hashes=r.block_hashes,
                                        max_tokens=1, lora_name=r.lora_name, lora_id=r.lora_id,
                                        cache_salt=r.cache_salt))
        clock.advance(res.e2e_s + 0.01)
        for e in engines:
            e.tick()
    return engines


def held(engines: list[SimEngine]) -> tuple[dict[str, int], dict[str, int]]:
    """Resident blocks per adapter and per tenant over the engines' caches (unlabelled: ``none``)."""
    adapters: Counter[str] = Counter()
    tenants: Counter[str] = Counter()
    for eng in engines:
        for (lora, salt), n in eng.cache.resident_by_label().items():
            adapters[lora or NONE] += n
            tenants[salt or NONE] += n
    return dict(adapters), dict(tenants)
