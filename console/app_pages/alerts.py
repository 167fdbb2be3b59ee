"""Alerts: firing alerts grouped like Alertmanager, each with its runbook and dashboard."""

import streamlit as st

from console import data, ui
from console.alert_groups import group_alerts
from console.http_json import SourceUnavailable
from console.links import grafana_link, load_thresholds, runbook_link
from console.settings import link_settings

st.title("Alerts")
thresholds = load_thresholds()
links = link_settings()

with st.spinner("Loading alerts…"):
    try:
        alerts, notes = data.firing_alerts(data.sources())
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()
ui.banners(notes)

groups = group_alerts(alerts)
st.metric("Firing alert groups", len(groups))
if not groups:
    st.success("Nothing is firing.", icon=":material/check_circle:")
for g in groups:
    with st.container(border=True, key=f"alert-{g.alertname}"):
        step = f" · step {g.step}" if g.step is not None else ""
        st.markdown(f"### {g.alertname} · {g.severity}{step} · {len(g.rows)} firing")
        shared = ", ".join(f"`{k}={v}`" for k, v in sorted(g.common_labels.items()) if k != "alertname")
        if shared:
            st.caption(f"Shared labels: {shared}")
        st.table([{"labels": ", ".join(f"{k}={v}" for k, v in sorted(r.labels.items())) or "—",
                   "since": r.active_at or "—", "value": r.value, "summary": r.summary} for r in g.rows])
        if g.known:
            line = f"[runbook]({runbook_link(g.alertname, links)})"
            grafana = grafana_link(g.alertname, links, thresholds)
            if grafana:
                line += f" · [Grafana panel]({grafana})"
            st.markdown(line)
