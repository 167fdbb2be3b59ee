"""Workers & topology: liveness, capacity, effective cache value, safe-to-remove, domains, migrations."""

import pandas as pd
import streamlit as st

from console import data, ui
from console.chain import Chain
from console.http_json import SourceUnavailable
from console.liveness import classify, liveness_from_api
from console.readings import check_shown, missing_signals, shown_text
from console.tree_view import (
    capacity_rows,
    domain_rows,
    left_pool,
    migration_rows,
    removal_ranking,
    stream_rows,
)

st.title("Workers & topology")
src = data.sources()

with st.spinner("Loading workers…"):
    try:
        chain, notes = data.chain(src)
        # The exporter as the source lists its workers whole (liveness included); beside
        # Prometheus, liveness is read from the exporter's series as the alerts see them.
        listing = data.workers(src.exporter_url) if chain.source == "exporter" else None
        workers = (listing if listing is not None else data.hotspots(src.exporter_url, 10)).get("workers") or []
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()
ui.banners(notes)

if listing is not None:
    liveness = liveness_from_api(workers)
    pool = listing.get("pool_size")
else:
    try:
        view = data.pool_view(src.exporter_url)
    except SourceUnavailable as exc:
        view = None
        st.warning(f"Worker liveness is unknown: {exc}", icon=":material/warning:")
    served = [str(w.get("worker")) for w in workers if w.get("effective_cache_value_tokens") is not None]
    liveness = classify([str(w.get("worker")) for w in workers], view, served) if view is not None else {}
    pool = view.pool_size if view is not None else None


def check_metric(col, ch: Chain, key: str) -> None:
    state = next((c for s in ch.steps for c in s.checks if c.check.key == key), None)
    if state is None:
        col.metric(key.replace("_", " "), "—")
        return
    col.metric(state.check.title, ui.fmt(state.value, state.check.unit),
               help=f"alert when {state.check.op} {ui.fmt(state.threshold, state.check.unit)}")
    col.markdown(shown_text(check_shown(state)))


m = st.columns(4)
check_metric(m[0], chain, "prefix_block_count_per_worker")
check_metric(m[1], chain, "topology_aware_placement_hit_rate")
check_metric(m[2], chain, "session_migration_count_per_minute")
check_metric(m[3], chain, "cross_node_migration_count_per_minute")

st.subheader("Liveness")
counts = {state: sum(1 for v in liveness.values() if v == state) for state in ("up", "down", "left the pool", "unknown")}
lv = st.columns(4)
lv[0].metric("Up", counts["up"])
lv[1].metric("Down", counts["down"], help="Fails its scrape or a router marks it unhealthy, yet still gets traffic.")
lv[2].metric("Left the pool", counts["left the pool"], help="Down or silent, and no traffic since: not ranked below.")
lv[3].metric("Pool size (exporter)", ui.fmt(pool, ""), help="Workers the exporter sees healthy right now.")
if workers and listing is not None:
    ui.table(stream_rows(workers, liveness, listing.get("evaluated_at")), "liveness")
    st.caption("Hit share: the worker's part of the cluster's hit tokens in the window. KV gaps and lost batches "
               "count since the exporter started; a gap the replay healed is not a loss.")
elif workers:
    ui.table(capacity_rows(workers, liveness), "liveness", columns=("worker", "liveness", "node", "resident_blocks"))
if counts["unknown"]:
    st.caption(f"The exporter's pool has {ui.fmt(pool, '')} of {len(workers)} workers seen, but no scrape or "
               "router health says which are missing: those are shown as unknown.")

st.subheader("Blocks against capacity")
# A worker that is down or left the pool serves no one: its cache is not capacity (listed apart).
every = capacity_rows(workers, liveness)
rows = [r for r in every if r["liveness"] not in ("left the pool", "down")]
out_of_service = [str(r["worker"]) for r in every if r["liveness"] in ("left the pool", "down")]
if out_of_service:
    st.caption(f"Not counted as capacity (down or left the pool): {', '.join(out_of_service)}.")
block_check = next((c for s in chain.steps for c in s.checks if c.check.key == "prefix_block_count_per_worker"), None)
if rows and any(r["resident_blocks"] is not None for r in rows):
    frame = pd.DataFrame(rows).rename(columns={"resident_blocks": "Resident blocks", "capacity_blocks": "Capacity"})
    st.bar_chart(frame, x="worker", y=["Resident blocks", "Capacity"], stack=False, height=260,
                 x_label="worker", y_label="blocks")
elif block_check is not None and check_shown(block_check) == "not_instrumented":
    st.caption(f"No worker reports resident blocks: not instrumented (missing signal: "
               f"{', '.join(missing_signals(block_check))}).")
else:
    st.caption("No worker holds resident blocks yet: no data in the window.")

st.subheader("Effective cache value and safe-to-remove ranking")
st.caption("Effective cache value = resident tokens × recent hit rate. Rank 1 loses the least cache if removed. "
           "Workers that left the pool are not ranked.")
ranking = removal_ranking(workers, liveness)
if ranking:
    ui.table(ranking, "removal_ranking", columns=("removal_rank", "worker", "liveness", "effective_cache_value_tokens",
                                                  "resident_blocks", "capacity_blocks", "used", "warm_pool"))
gone = left_pool(workers, liveness)
if gone:
    st.markdown("**Left the pool** (their cache no longer serves anyone)")
    ui.table(gone, "left_pool")

st.subheader("Sessions that migrated away")
moved = migration_rows(workers, liveness)
if moved:
    st.caption("Per worker, the sessions whose next turn went to another worker in the window: a killed "
               "worker's sessions move (hard: their cache stayed behind).")
    ui.table(moved, "migrated_away")
else:
    st.caption("No session migrated away from any worker in the window.")

st.subheader("NVLink domains")
domains = domain_rows(workers)
if domains:
    ui.table(domains, "domains")
else:
    st.caption("No topology file: workers have no node or NVLink domain.")

if chain.source == "prometheus" and src.prometheus_url:
    st.subheader("Migrations per minute by kind")
    try:
        moves = data.by_label(src.prometheus_url, "prefixscope_session_migrations_total", "kind", per_minute=True)
        cross = data.by_label(src.prometheus_url, "prefixscope_cross_node_migrations_total", "kind", per_minute=True)
    except SourceUnavailable as exc:
        ui.source_down(exc)
    else:
        kinds = sorted(set(moves) | set(cross))
        ui.table([{"kind": k, "session_migrations_per_min": moves.get(k), "cross_node_per_min": cross.get(k)}
                  for k in kinds], "migrations")
