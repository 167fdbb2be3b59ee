"""Workers & topology: capacity, effective cache value, safe-to-remove, domains, migrations."""

import pandas as pd
import streamlit as st

from console import data, ui
from console.chain import Chain
from console.http_json import SourceUnavailable
from console.tree_view import capacity_rows, domain_rows, removal_ranking

st.title("Workers & topology")
src = data.sources()

with st.spinner("Loading workers…"):
    try:
        workers = data.hotspots(src.exporter_url, 10).get("workers") or []
        chain, notes = data.chain(src)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()
ui.banners(notes)


def check_metric(col, ch: Chain, key: str) -> None:
    state = next((c for s in ch.steps for c in s.checks if c.check.key == key), None)
    if state is None:
        col.metric(key, "—")
        return
    col.metric(state.check.title, ui.fmt(state.value, state.check.unit),
               help=f"alert when {state.check.op} {ui.fmt(state.threshold, state.check.unit)}")
    col.caption(ui.status_text(state.status))


m = st.columns(4)
check_metric(m[0], chain, "prefix_block_count_per_worker")
check_metric(m[1], chain, "topology_aware_placement_hit_rate")
check_metric(m[2], chain, "session_migration_count_per_minute")
check_metric(m[3], chain, "cross_node_migration_count_per_minute")

st.subheader("Blocks against capacity")
rows = capacity_rows(workers)
if rows:
    frame = pd.DataFrame(rows)
    st.bar_chart(frame, x="worker", y=["resident_blocks", "capacity_blocks"], stack=False, height=260)
else:
    st.caption("No worker reports resident blocks (KV events not instrumented).")

st.subheader("Effective cache value and safe-to-remove ranking")
st.caption("Effective cache value = resident tokens × recent hit rate. Rank 1 loses the least cache if removed.")
ranking = removal_ranking(workers)
if ranking:
    st.dataframe(pd.DataFrame(ranking)[["removal_rank", "worker", "effective_cache_value_tokens", "resident_blocks",
                                        "capacity_blocks", "used", "warm_pool"]],
                 hide_index=True, key="removal_ranking")

st.subheader("NVLink domains")
domains = domain_rows(workers)
if domains:
    st.dataframe(pd.DataFrame(domains), hide_index=True, key="domains")

if chain.source == "prometheus" and src.prometheus_url:
    st.subheader("Migrations per minute by kind")
    try:
        moves = data.by_label(src.prometheus_url, "prefixscope_session_migrations_total", "kind", per_minute=True)
        cross = data.by_label(src.prometheus_url, "prefixscope_cross_node_migrations_total", "kind", per_minute=True)
    except SourceUnavailable as exc:
        ui.source_down(exc)
    else:
        kinds = sorted(set(moves) | set(cross))
        st.dataframe(pd.DataFrame([{"kind": k, "session_migrations_per_min": moves.get(k),
                                    "cross_node_per_min": cross.get(k)} for k in kinds]), hide_index=True)
