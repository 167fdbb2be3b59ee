"""Prefix tree: the cluster-wide radix tree as a first-class object (seed §7, corollary 5)."""

from dashboards import queries as q
from dashboards.common import bargauge, finalize, row, stat, table, target, timeseries
from dashboards.drawing import Drawing, Drawn

TITLE = "Prefix tree"

def build(drawing: Drawing) -> Drawn:
    panels = [
        *row("Shape: depth and fan-out", [
            timeseries("Leaf depth p50 / p99 (radix edges)", [
                target(q.quantile(0.5, "prefix_tree_leaf_depth", rated=False), "p50"),
                target(q.rule("cluster:prefixscope_prefix_tree_leaf_depth:p99"), "p99")],
                description="Depth of leaves in the radix-compressed tree: runs without branching count as one edge."),
            timeseries("Leaf depth p99 (blocks)", [
                target(q.quantile(0.99, "prefix_tree_leaf_block_depth", rated=False), "p99 blocks")],
                unit="blocks", description="Raw leaf depth in KV blocks: how long the cached prompts are."),
            timeseries("Root fan-out", [target(q.series("prefix_tree_root_fanout"), "distinct first blocks")],
                       description="Distinct first blocks. A jump means the shared prefix broke (e.g. a timestamp "
                                   "in the system prompt): every request starts its own branch."),
            bargauge("Fan-out per branching node", [
                target(f"sum by (le) ({q.metric('prefix_tree_node_fanout')}_bucket)", "≤ {{le}}", instant=True)],
                description="Cumulative count of branching nodes by number of children."),
        ]),
        *row("Size and duplication", [
            stat("Nodes (radix edges)", [target(q.series("prefix_tree_nodes"))]),
            stat("Distinct blocks", [target(q.series("prefix_tree_blocks"))], unit="blocks"),
            bargauge("Blocks by number of replicas", [
                target(f"sum by (le) ({q.metric('prefix_tree_block_replicas')}_bucket)", "on ≤ {{le}} workers",
                       instant=True)],
                description="Duplication of the same block across workers (cumulative). Heavy duplication "
                            "wastes capacity; none at all can mean affinity is too strict for hot prefixes."),
        ]),
        *row("Hot branches and what changed", [
            table("Hot branches (top K by hit tokens)", [
                target(q.series("hot_branch_hit_tokens"), instant=True, table=True)],
                description="Bounded top-K; the full tree is at the exporter's /api/v1/tree and /api/v1/hotspots."),
            timeseries("Re-keyed sessions by segment", [
                target(f"sum by (segment) ({q.rate('session_rekeys')})", "{{segment}}")], unit="per_second",
                description="New session keys whose first prompt matches a recent session's chain: cookie resets, "
                            "re-derived conversation ids."),
            timeseries("Session reshuffle after pool change", [target(q.series("session_reshuffle_ratio"), "reshuffled")],
                       unit="ratio", description="Share of sessions whose worker changed across the last pool change "
                                                 "(hash-mod routing reshuffles almost all of them)."),
        ]),
    ]

    return finalize(TITLE, __file__, panels, drawing=drawing, description=(
        "When the hit rate drops, look at the tree before the GPUs: which branches lost hits, "
        "which segments re-keyed, did a pool change reshuffle keys."))
