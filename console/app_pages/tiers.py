"""Cache tiers: is offloading paying off? What the offload tiers hold against what they serve."""

import streamlit as st

from console import data, ui
from console.http_json import SourceUnavailable
from console.tiers import LMCACHE_COLUMNS, PAYING_SHARE, cluster_summary, offload_rows
from prefixscope.units import format_duration

st.title("Cache tiers")
st.caption("Is offloading paying off? Blocks the offload tiers (the KV events' CPU, STORAGE, … media) hold, "
           "against the cached tokens they serve, per worker over the exporter's window.")
src = data.sources()

with st.spinner("Loading workers…"):
    try:
        listing = data.workers(src.exporter_url)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()

window_s = float(listing.get("window_s") or 0.0)
rows = offload_rows(listing.get("workers") or [], window_s)
if not rows:
    st.info("No worker reports an offload tier: no KV events with a medium other than GPU, no per-tier cached "
            "tokens, no external prefix-cache counters and no LMCache.", icon=":material/info:")
    st.stop()

total = cluster_summary(rows)
m = st.columns(3)
m[0].metric("Offload blocks held", ui.fmt(total["offload_blocks"], "blocks"))
m[1].metric("Cached tokens served from offload", ui.fmt(total["offload_hit_tokens"], "tokens"),
            help=f"In the last {format_duration(window_s)}.")
m[2].metric("Workers paying off", f"{sum(1 for r in rows if r['verdict'].startswith('paying'))} of {len(rows)}",
            help=f"An offload tier pays off when it serves at least {PAYING_SHARE:.0%} of the cached tokens.")
lmcache = [r for r in rows if any(r[k] is not None for k in LMCACHE_COLUMNS)]
ui.table([{k: v for k, v in r.items() if k not in LMCACHE_COLUMNS} for r in rows], "offload")
st.caption("Served from offload: cached tokens of every tier but the GPU (vLLM's prompt_tokens_cached_by_source, "
           "SGLang's cache_source), else the KV connector's external hits (vLLM, LMCache). Offload capacity is "
           "estimated from vLLM's offload usage; — is missing, never 0.")
if lmcache:
    st.subheader("LMCache")
    ui.table(lmcache, "lmcache", columns=("worker", *LMCACHE_COLUMNS))
    st.caption(f"LMCache's own view over the last {format_duration(window_s)}: the share of the tokens it was asked "
               "to look up that it held, and how long its retrieves (loads into the GPU), stores and lookups take. "
               "A retrieve slower than the prefill it saves costs more than it serves.")
