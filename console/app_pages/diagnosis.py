"""Diagnosis chain: steps 0–5 in order, the verdict, and the reuse decomposition."""

import pandas as pd
import streamlit as st

from console import data, ui
from console.chain import reuse_reading
from console.http_json import SourceUnavailable
from console.links import dashboard_url, load_thresholds, runbook_url

st.title("Diagnosis chain")
st.caption("Walks the checklist in order. A falling cluster hit rate starts the walk; the verdict "
           "is the first step whose own cause signals fail.")

src = data.sources()
thresholds = load_thresholds()
range_label = st.selectbox("Sparkline range", list(data.RANGES_S), index=1, key="diagnosis_range")

with st.spinner("Walking the chain…"):
    try:
        chain, notes = data.chain(src)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()
ui.banners(notes)

verdict = chain.verdict
if verdict is None:
    st.success("Verdict: no step fails its cause checks.", icon=":material/check_circle:")
else:
    failing = ", ".join(c.check.title for c in verdict.firing_causes)
    st.error(f"Verdict: step {verdict.number} — {verdict.title}. {verdict.question} Failing: {failing}.", icon=":material/route:")

if chain.symptom is not None:
    s = chain.symptom
    st.markdown(f"Symptom that starts the walk — {ui.check_line(s)}")

st.subheader("Reuse decomposition")
r = chain.reuse
cols = st.columns(5)
cols[0].metric("Available", ui.fmt(r.available, "ratio"), help="Longest cached match on any worker (index).")
cols[1].metric("Predicted", ui.fmt(r.predicted, "ratio"), help="What the router believed cached on its choice.")
cols[2].metric("Achieved", ui.fmt(r.achieved, "ratio"), help="What the engines reported cached.")
cols[3].metric("Routing regret", ui.fmt(r.routing_regret, "ratio"), help="Available − achieved.")
cols[4].metric("Index staleness", ui.fmt(r.index_staleness, "ratio"), help="Predicted − achieved.")
st.info(reuse_reading(r, thresholds))

sparkline_url = src.prometheus_url if chain.source == "prometheus" else None
for step in chain.steps:
    with st.container(border=True, key=f"step-{step.number}"):
        st.markdown(f"### Step {step.number} — {step.title} · {ui.status_text(step.status)}")
        st.caption(step.question)
        for c in step.checks:
            text, spark = st.columns([3, 2])
            role = "" if c.cause else (" _(symptom)_" if c.check.kind != "slo" else " _(SLO)_")
            text.markdown(ui.check_line(c) + role)
            runbook = runbook_url(c.check.alert, thresholds)
            text.markdown(f"[Grafana panel]({dashboard_url(c.check.alert, thresholds)}) · "
                          f"[runbook]({runbook}) · [read here](./runbook?alert={c.check.alert})")
            if sparkline_url:
                try:
                    points = data.sparkline(sparkline_url, c.check.key, data.RANGES_S[range_label])
                except SourceUnavailable:
                    points = []
                if points:
                    frame = pd.DataFrame(points, columns=["time", "value"])
                    frame["time"] = pd.to_datetime(frame["time"], unit="s")
                    spark.line_chart(frame, x="time", y="value", height=90)
                else:
                    spark.caption("no data in range")
