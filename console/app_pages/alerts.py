"""Alerts: firing and pending alerts grouped like Alertmanager, each with its runbook and
dashboard; with Alertmanager configured, which of them page and which are inhibited or silenced."""

import time

import streamlit as st

from console import data, ui
from console.alert_groups import AlertGroup, group_alerts, value_text
from console.alertmanager import pages, rule_rows, silence_rows, table_rows
from console.http_json import SourceUnavailable
from console.links import grafana_link, runbook_link
from console.settings import ALERTMANAGER_ENV, link_settings
from prefixscope.units import format_moment, parse_timestamp

st.title("Alerts")
links = link_settings()
src = data.sources()

with st.spinner("Loading alerts…"):
    try:
        alerts, notes = data.firing_alerts(src)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()
ui.banners(notes)

firing = group_alerts(alerts)
pending = group_alerts(alerts, state="pending")
counts = st.columns(2)
counts[0].metric("Firing alert groups", len(firing))
counts[1].metric("Pending alert groups", len(pending), help="Past their threshold; the alert fires once "
                 "the breach has lasted its `for`.")
if not firing and not pending:
    st.success("Nothing is firing or pending.", icon=":material/check_circle:")


def show_group(g: AlertGroup, state: str) -> None:
    """One alert group: its rows, the labels they share, its runbook and panel."""
    with st.container(border=True, key=f"alert-{state}-{g.alertname}"):
        step = f" · step {g.step}" if g.step is not None else ""
        st.markdown(f"### {g.alertname} · {g.severity}{step} · {len(g.rows)} {state}")
        shared = ", ".join(f"`{k}={v}`" for k, v in sorted(g.common_labels.items()) if k != "alertname")
        if shared:
            st.caption(f"Shared labels: {shared}")
        now = time.time()
        st.table(ui.readable_rows([{
            "labels": ", ".join(f"{k}={v}" for k, v in sorted(r.labels.items())) or "—",
            "since": format_moment(at, ui.zone(), now) if (at := parse_timestamp(r.active_at)) is not None else "—",
            "value": r.value if ":" in r.value else value_text(g.alertname, r.value),
            "summary": r.summary} for r in g.rows]))
        if g.known:
            line = f"[runbook]({runbook_link(g.alertname, links)})"
            grafana = grafana_link(g.alertname, links)
            if grafana:
                line += f" · [Grafana panel]({grafana})"
            st.markdown(line)


for g in firing:
    show_group(g, "firing")
if pending:
    st.subheader("Pending")
    st.caption("Past their threshold, not fired yet: each fires if the breach lasts its `for`.")
    for g in pending:
        show_group(g, "pending")

st.subheader("Alertmanager")
if not src.alertmanager_url:
    st.caption(f"Not configured (set {ALERTMANAGER_ENV} or --alertmanager-url): which alerts page and which "
               "are inhibited or silenced is not shown.")
else:
    try:
        held = data.alertmanager_alerts(src.alertmanager_url)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        held = None
    if held is not None:
        paging = pages(held)
        st.caption(f"{len(paging)} of {len(held)} alerts page; the others are inhibited by an earlier "
                   "step's alert or silenced.")
        if held:
            st.table(ui.readable_rows([r | {"since": format_moment(at, ui.zone(), time.time())
                                            if (at := parse_timestamp(r["since"])) is not None else "—"}
                                       for r in table_rows(held)]))
        else:
            st.caption("Alertmanager holds no alerts.")
    st.markdown("#### Silences")
    try:
        silences = data.alertmanager_silences(src.alertmanager_url)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        silences = None
    if silences:
        st.table(ui.readable_rows([r | {"until": format_moment(at, ui.zone(), time.time())
                                        if (at := parse_timestamp(r["until"])) is not None else "—"}
                                   for r in silence_rows(silences)]))
    elif silences is not None:
        st.caption("No silences.")
    st.markdown("#### Inhibition rules")
    st.caption("While an alert on the left fires, Alertmanager holds back the alerts on the right that share "
               "its labels in the last column: an incident pages once, at its first failing step.")
    try:
        rules = data.alertmanager_inhibit_rules(src.alertmanager_url)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        rules = None
    if rules:
        st.table(ui.readable_rows(rule_rows(rules)))
    elif rules is not None:
        st.caption("Alertmanager runs without inhibition rules: every alert pages on its own.")
