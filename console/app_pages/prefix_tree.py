"""Prefix tree: the top of the cluster tree, hot branches, shape, duplication, what changed."""

import time

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from console import data, ui
from console.http_json import SourceUnavailable
from console.liveness import classify
from console.tree_view import bucket_rows, hot_branch_rows, icicle_columns, lost_rows

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

cols = icicle_columns(tree.get("root") or {"id": "root"}, by, min_share=0.03)
fig = go.Figure(go.Icicle(ids=cols["ids"], labels=cols["labels"], parents=cols["parents"], values=cols["values"],
                          branchvalues="total", customdata=cols["hover"], root_color="#d9dde3", maxdepth=4,
                          textinfo="label", tiling={"orientation": "v"}, insidetextfont={"size": 13},
                          hovertemplate="%{customdata}<extra></extra>"))
fig.update_layout(margin={"t": 10, "l": 0, "r": 0, "b": 0}, height=420, uniformtext={"minsize": 11, "mode": "hide"})
st.plotly_chart(fig, key="tree_icicle")
st.caption("Each box is a branch of the cluster's prefix tree, named by its first words, as wide as its "
           f"{'cached tokens in the window' if by == 'hits' else 'blocks'}; branches too thin to read are "
           "gathered into “n more”. Hover for the full text, its tenant and adapter, and the workers holding it.")

st.subheader("Hot branches")
branches = hot.get("hot_branches") or []
seen = hot.get("workers") or []
try:
    liveness = classify([str(w.get("worker")) for w in seen], data.pool_view(src.exporter_url),
                        [str(w.get("worker")) for w in seen if w.get("effective_cache_value_tokens") is not None])
except SourceUnavailable:
    liveness = {}  # unknown liveness: list every holder the index names
if branches:
    st.caption("Workers: those in the pool that hold the branch (a worker that left the pool is not listed). "
               "Click a prefix cell to read it whole.")
    ui.table(hot_branch_rows(branches, liveness), "hot_branches", wide=("prefix",),
             columns=("rank", "prefix", "tenant", "adapter", "hit_tokens", "sessions", "blocks", "workers", "branch"))
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


def table_or_none(title: str, rows: list, key: str, wide: tuple[str, ...] = ()) -> None:
    """A titled table, or "None." when the window has nothing (statements only: no Streamlit magic)."""
    st.markdown(f"**{title}**")
    if rows:
        ui.table(rows, key, wide=wide)
    else:
        st.caption("None.")


table_or_none("Branches that lost hits", lost_rows(ch.get("lost_hits") or []), "lost_hits", wide=("prefix",))
table_or_none("Segments whose session keys churned", ch.get("rekeyed_segments") or [], "rekeyed_segments")
table_or_none("Pool changes that reshuffled keys", ch.get("pool_changes") or [], "pool_changes")
