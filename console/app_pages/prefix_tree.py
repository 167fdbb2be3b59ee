"""Prefix tree: the top of the cluster tree, hot branches, shape, duplication, what changed."""

import time

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from console import charts, data, ui
from console.http_json import SourceUnavailable
from console.liveness import classify
from console.settings import timezone_name
from console.tree_view import bucket_rows, hot_branch_rows, icicle_columns

st.title("Prefix tree")
src = data.sources()

left, mid, right = st.columns(3)
by = left.radio("Size by", ["hits", "blocks"], horizontal=True, key="tree_by")
depth = mid.slider("Depth", 1, 8, 4, key="tree_depth")
k = right.slider("Hot branches", 5, 50, 10, key="tree_k")

with st.spinner("Loading the prefix tree…"):
    try:
        # The branches that matter, readable: about four tree nodes per hot branch asked for.
        tree = data.tree(src.exporter_url, depth, by, 4 * k)
        hot = data.hotspots(src.exporter_url, k)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()

stats = tree.get("stats") or {}
c = st.columns(4)
c[0].metric("Nodes", ui.fmt(stats.get("nodes"), ""))
c[1].metric("Blocks", ui.fmt(stats.get("blocks"), ""))
c[2].metric("Root fan-out", ui.fmt(stats.get("root_fanout"), ""), help="Distinct first blocks: a jump means a broken shared prefix.")
c[3].metric("Depth p99 (edges)", ui.fmt(stats.get("depth_p99"), ""))

cols = icicle_columns(tree.get("root") or {"id": "root"}, by, min_share=0.02)
fig = go.Figure(go.Icicle(ids=cols["ids"], labels=cols["labels"], parents=cols["parents"], values=cols["values"],
                          branchvalues="remainder", customdata=cols["workers"], root_color="#d9dde3",
                          hovertemplate="%{label}<br>%{value:,.0f} " + by + "<br>workers: %{customdata}<extra></extra>"))
fig.update_layout(margin={"t": 10, "l": 0, "r": 0, "b": 0}, height=380)
st.plotly_chart(fig, key="tree_icicle")

st.subheader("Hot branches")
branches = hot.get("hot_branches") or []
seen = hot.get("workers") or []
try:
    liveness = classify([str(w.get("worker")) for w in seen], data.pool_view(src.exporter_url),
                        [str(w.get("worker")) for w in seen if w.get("effective_cache_value_tokens") is not None])
except SourceUnavailable:
    liveness = {}  # unknown liveness: list every holder the index names
if branches:
    st.caption("Workers column: workers in the pool that hold the branch (a worker that left the pool is not listed).")
    st.dataframe(pd.DataFrame(hot_branch_rows(branches, liveness)), hide_index=True, key="hot_branches")
else:
    st.caption("No hits recorded in the window.")

st.subheader("Shape")
shape_left, shape_right = st.columns(2)
fanout = bucket_rows((hot.get("fanout") or {}).get("buckets"), "children", "nodes")
depth_rows = bucket_rows((hot.get("depth") or {}).get("buckets"), "depth", "leaves")
shape_left.markdown("**Fan-out of branching nodes**")
if fanout:
    shape_left.bar_chart(pd.DataFrame(fanout), x="children", y="nodes", height=220)
shape_right.markdown("**Leaf depth (radix edges)**")
if depth_rows:
    shape_right.bar_chart(pd.DataFrame(depth_rows), x="depth", y="leaves", height=220)

st.subheader("Duplication across workers")
dup = hot.get("duplication") or {}
d = st.columns(4)
d[0].metric("Blocks on 1 worker", ui.fmt(dup.get("blocks_on_1"), ""))
d[1].metric("On 2 workers", ui.fmt(dup.get("blocks_on_2"), ""))
d[2].metric("On 3+ workers", ui.fmt(dup.get("blocks_on_3_plus"), ""))
d[3].metric("Duplicated share", ui.fmt(dup.get("duplicated_share"), "ratio"))

st.subheader("What changed")
w1, w2 = st.columns(2)
from_ago = w1.number_input("Earlier window ends (minutes ago)", 1, 1440, 5, key="changes_from")
to_ago = w2.number_input("Later window ends (minutes ago)", 0, 1440, 0, key="changes_to")
now = time.time()
try:
    ch = data.changes(src.exporter_url, now - 60 * from_ago, now - 60 * to_ago)
except SourceUnavailable as exc:
    ui.source_down(exc)
    st.stop()


def table_or_none(title: str, rows: list, key: str) -> None:
    """A titled table, or "None." when the window has nothing (statements only: no Streamlit magic)."""
    st.markdown(f"**{title}**")
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, key=key)
    else:
        st.caption("None.")


table_or_none("Branches that lost hits", ch.get("lost_hits") or [], "lost_hits")
table_or_none("Segments whose session keys churned", ch.get("rekeyed_segments") or [], "rekeyed_segments")
tz = charts.zone(timezone_name())
pools = [p | {"ts": charts.timestamp_text(p["ts"], tz)} if isinstance(p.get("ts"), int | float) else p
         for p in ch.get("pool_changes") or []]
table_or_none("Pool changes that reshuffled keys", pools, "pool_changes")
