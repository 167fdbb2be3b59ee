"""Workers & topology: capacity, cache value, placement and migrations per worker."""

from dashboards import queries as q
from dashboards.common import bargauge, finalize, row, table, target, timeseries
from dashboards.drawing import Drawing, Drawn

TITLE = "Workers & topology"

def build(drawing: Drawing) -> Drawn:
    panels = [
        *row("Capacity and cache value", [
            timeseries("Resident blocks vs capacity", [
                target(q.series("worker_resident_blocks"), "{{worker}} resident"),
                target(q.series("worker_capacity_blocks"), "{{worker}} capacity")], unit="blocks",
                description="Blocks resident on each worker (from KV events) against num_gpu_blocks."),
            bargauge("Fill ratio per worker", [
                target(f'{q.rule("worker:prefixscope_worker_resident_blocks_per_capacity:ratio")}{{worker=~"$worker"}}',
                       "{{worker}}", instant=True)], unit="ratio", maximum=1),
            timeseries("Effective cache value", [
                target(q.series("worker_effective_cache_value_tokens"), "{{worker}}")], unit="tokens",
                description="Resident tokens × recent hit ratio (seed corollary 2): the autoscaling signal."),
            table("Safe-to-remove ranking", [
                target(q.series("worker_removal_rank"), instant=True, table=True),
                target(q.series("worker_info"), instant=True, table=True)],
                description="Rank 1 is the safest worker to remove: its cache is easiest for neighbours to absorb."),
        ]),
        *row("Placement and migrations", [
            timeseries("Topology-aware placement per model", [
                target(q.ratio_by("placement_domain_hits", "placement_decisions", "model", drawing.window), "{{model}} (records)"),
                target(q.ratio_by("kv_placement_domain_hits", "kv_placement_decisions", "model", drawing.window), "{{model}} (KV events)")],
                unit="ratio", description="Requests placed in the NVLink domain that holds their longest cached prefix: "
                                          "exact per request from records with block hashes; from KV events, one "
                                          "judgement per request at its first block store."),
            timeseries("Session migrations by kind", [
                target(f"sum by (kind) ({q.rate('session_migrations')}) * 60", "{{kind}}")], unit="per_minute"),
            timeseries("Cross-node migrations by kind", [
                target(f"sum by (kind) ({q.rate('cross_node_migrations')}) * 60", "{{kind}}")], unit="per_minute"),
            timeseries("Warm-pool utilisation", [target(q.series("warm_pool_utilization_ratio"), "{{worker}}")],
                       unit="ratio"),
        ]),
        *row("Cache tiers — is offloading paying off?", [
            timeseries("Resident blocks vs capacity per tier", [
                target(f"sum by (medium) ({q.series('worker_medium_resident_blocks')})", "{{medium}} resident"),
                target(f"sum by (medium) ({q.series('worker_medium_capacity_blocks')})", "{{medium}} capacity")],
                unit="blocks", description="Blocks each cache tier (the KV events' medium) holds, against its capacity: "
                                           "GPU from num_gpu_blocks, CPU estimated from vLLM's offload usage."),
            timeseries("Cached tokens by the tier that served them", [
                target(f"sum by (tier) ({q.rate('prefix_cache_tier_hit_tokens')})", "{{tier}}")],
                unit="per_second", stack=True,
                description="vLLM's prompt_tokens_cached_by_source (device = GPU; host, disk, p2p: offload and "
                            "transfer tiers) or SGLang's cache_source."),
            timeseries("Offload share of cached tokens and external hit ratio", [
                target(f"{q.offload_hit_tokens_rate()} / sum ({q.rate('prefix_cache_tier_hit_tokens')})",
                       "served by offload tiers"),
                target(f"sum ({q.rate('external_prefix_cache_hit_tokens')}) / "
                       f"sum ({q.rate('external_prefix_cache_queried_tokens')})", "external (connector) hit ratio")],
                unit="ratio", description="How much of the reuse the offload tiers deliver, and how often the KV "
                                          "connector (offload, LMCache) finds what it is asked for."),
            timeseries("Offload hits per 1k blocks held", [
                target(f"{q.offload_hit_tokens_rate()} / ({q.offload_resident_blocks()} / 1000)",
                       "hit tokens/s per 1k offload blocks")], unit="per_second",
                description="What the offload tiers serve against what they hold: near 0 while they hold many blocks "
                            "means the offload memory is not paying off."),
            timeseries("LMCache: lookup hit ratio per worker", [
                target(q.ratio_by("lmcache_lookup_hit_tokens", "lmcache_lookup_queried_tokens", "worker", drawing.window),
                       "{{worker}}")], unit="ratio",
                description="Tokens LMCache held of those it was asked to look up (lmcache:num_lookup_hits ÷ "
                            "num_lookup_tokens). Without LMCache: no data."),
            timeseries("LMCache: time per operation", [
                target(q.quantile(0.5, "lmcache_operation_seconds", "operation", over=drawing.window),
                       "{{operation}} p50"),
                target(q.quantile(0.99, "lmcache_operation_seconds", "operation", over=drawing.window),
                       "{{operation}} p99")], unit="seconds",
                description="LMCache's retrieve (load into the GPU), store (save from it) and lookup times: a "
                            "retrieve slower than the prefill it saves means the tier costs more than it serves."),
        ]),
        *row("Tenants and LoRA adapters", [
            timeseries("Resident blocks per tenant", [
                target(f"sum by (tenant) ({q.series('tenant_resident_blocks')})", "{{tenant}}")], unit="blocks",
                stack=True, description="By the cache_salt of each chain's first block (none: unsalted; other: past "
                                        "limits.tenants)."),
            timeseries("Resident blocks per LoRA adapter", [
                target(f"sum by (adapter) ({q.series('adapter_resident_blocks')})", "{{adapter}}")], unit="blocks",
                stack=True, description="By BlockStored's lora_name (none: the base model)."),
            timeseries("Hit ratio per tenant", [
                target(q.ratio_by("tenant_prefix_cache_hit_tokens", "tenant_prefix_cache_queried_tokens", "tenant", drawing.window),
                       "{{tenant}}")], unit="ratio",
                description="Engine-reported cached ÷ prompt tokens of requests naming the tenant (records, spans)."),
            timeseries("Hit ratio per LoRA adapter", [
                target(q.ratio_by("adapter_prefix_cache_hit_tokens", "adapter_prefix_cache_queried_tokens", "adapter", drawing.window),
                       "{{adapter}}")], unit="ratio"),
        ]),
        *row("Router view", [
            timeseries("Router decisions per worker", [
                target(f"sum by (worker) ({q.rate('router_decisions')})", "{{worker}}")], unit="per_second", stack=True),
            timeseries("Workers healthy (router)", [target(q.series("router_worker_healthy"), "{{router}} {{worker}}")]),
            timeseries("Engine hit ratio as the router polls it", [
                target(q.series("router_engine_hit_ratio"), "{{router}} {{worker}}")], unit="ratio", description=(
                "Each engine's own prefix-cache hit rate as the SGLang gateway last polled it (gRPC workers): the "
                "per-worker hit rate where the engines' /metrics are not scraped.")),
            timeseries("Requests per worker (records and spans)", [
                target(f"sum by (worker) ({q.rate('worker_requests')})", "{{worker}}")], unit="per_second", stack=True,
                description="What the request records and OTLP spans carried, per worker: against the router's "
                            "decisions, a worker whose spans do not arrive."),
            timeseries("Time to first token p95 per worker", [
                target(q.quantile(0.95, "worker_ttft_seconds", "worker", over=drawing.window), "{{worker}}")],
                unit="seconds", description="From records' ttft_s or spans' gen_ai.latency.time_to_first_token."),
            timeseries("Fallback ladder in use", [target(q.series("fallback_active"), "{{tier}}")],
                       description="1 while a fallback tier (re-sticky, warm pool, model downgrade, async prefill) "
                                   "is active and its exit condition is not met."),
        ]),
    ]

    return finalize(TITLE, __file__, panels, drawing=drawing, description=(
        "Per-worker capacity, effective cache value and removal ranking; placement and migrations."))
