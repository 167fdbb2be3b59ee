"""Workers & topology: capacity, cache value, placement and migrations per worker."""

from dashboards import queries as q
from dashboards.common import bargauge, finalize, row, table, target, timeseries

TITLE = "Workers & topology"

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
            target(q.ratio_by("placement_domain_hits", "placement_decisions", "model"), "{{model}}")],
            unit="ratio", description="Requests placed in the NVLink domain that holds their longest cached prefix."),
        timeseries("Session migrations by kind", [
            target(f"sum by (kind) ({q.rate('session_migrations')}) * 60", "{{kind}}")], unit="per_minute"),
        timeseries("Cross-node migrations by kind", [
            target(f"sum by (kind) ({q.rate('cross_node_migrations')}) * 60", "{{kind}}")], unit="per_minute"),
        timeseries("Warm-pool utilisation", [target(q.series("warm_pool_utilization_ratio"), "{{worker}}")],
                   unit="ratio"),
    ]),
    *row("Router view", [
        timeseries("Router decisions per worker", [
            target(f"sum by (worker) ({q.rate('router_decisions')})", "{{worker}}")], unit="per_second", stack=True),
        timeseries("Workers healthy (router)", [target(q.series("router_worker_healthy"), "{{router}} {{worker}}")]),
        timeseries("Fallback ladder in use", [target(q.series("fallback_active"), "{{tier}}")],
                   description="1 while a fallback tier (re-sticky, warm pool, model downgrade, async prefill) "
                               "is active and its exit condition is not met."),
    ]),
]

dashboard = finalize(TITLE, __file__, panels, description=(
    "Per-worker capacity, effective cache value and removal ranking; placement and migrations."))
