"""Diagnosis chain: steps 0–5 in order, the verdict, and the reuse decomposition."""

import streamlit as st

from console import charts, data, ui
from console.chain import SYMPTOM_KEY, CheckState, reuse_reading
from console.http_json import SourceUnavailable
from console.links import grafana_link, in_app_markdown, runbook_link, runbook_markdown
from console.readings import alert_terms, check_line, fires_in_text, settled_note, shown_text, step_shown
from console.runbook_steps import first_fitting
from console.settings import link_settings, timezone_name

st.title("Diagnosis chain")
st.caption("Walks the checklist in order. A falling cluster hit rate starts the walk; the verdict "
           "is the first step whose own cause signals fail: red when its alert fires, amber while it is "
           "past its threshold and the alert is pending, green when clear.")

src = data.sources()
links = link_settings()
# Charts need Prometheus's history: without it, there is no range to choose.
range_label = (st.selectbox("Chart range", list(data.RANGES_S), index=1, key="diagnosis_range")
               if src.prometheus_url else "1 hour")
range_s = data.RANGES_S[range_label]

with st.spinner("Walking the chain…"):
    try:
        chain, notes = data.chain(src)
    except SourceUnavailable as exc:
        ui.source_down(exc)
        st.stop()
ui.banners(notes)

headline = chain.headline
checks = chain.checks()
behind = [checks[k] for k in headline.checks if k in checks]
with st.container(border=True, key="headline"):
    # A missing family shard: the cluster's answer is partial, whatever the steps below say.
    if chain.partial is not None:
        st.warning(chain.partial, icon=":material/warning:")
    # The same evaluation the Alerts page lists: an SLO or the symptom firing alone is not CLEAR.
    uncaused = [c for c in checks.values() if not c.cause and c.status == "firing" and not c.context]
    if headline.state == "clear" and uncaused:
        st.warning("**NO CAUSE FOUND** · Verdict: no step fails its cause checks, yet "
                   + ", ".join(f"{c.check.title} ({ui.fmt(c.value, c.check.unit)})" for c in uncaused)
                   + " fires: the cause lies outside what is instrumented, or has not crossed its limit yet.",
                   icon=":material/help:")
    elif headline.state == "clear":
        st.success("**CLEAR** · Verdict: no step fails its cause checks, and none is past its threshold.",
                   icon=":material/check_circle:")
    else:
        step = headline.step
        where = (f"Verdict: step {step.number} — {step.title}. {step.question}" if step is not None else
                 "The cluster hit rate is below target and no instrumented step explains it.")
        failing = ", ".join(c.check.title for c in behind)
        if headline.state == "firing":
            st.error(f"**FIRING** · {where} Failing: {failing}.", icon=":material/error:")
        else:
            st.warning(f"**PENDING** · {where} Past its threshold: {failing}; "
                       f"{fires_in_text(headline.fires_in_s)} if it holds.", icon=":material/pending:")
        for c in behind:
            st.markdown(check_line(c))
            if c.culprits is None:
                continue
            for line in c.culprits.lines():
                st.markdown(f"- {line}")
            if not c.culprits.any:
                st.caption("No worker, prefix or session stands out from its peers for this check.")
            named = [p for p in c.culprits.prefixes if p.full]
            if named:
                with st.expander("Prefixes in full"):
                    for p in named:
                        st.markdown(f"- `{p.branch}` {p.full}")
        first = behind[0] if behind else None
        if first is not None:
            advice = first_fitting(first.check.alert, runbook_markdown(first.check.alert) or "",
                                   data.evidence(src, chain))
            if advice is not None:
                st.markdown(f"**First step** ([runbook]({runbook_link(first.check.alert, links)}), step "
                            f"{advice.number}): {in_app_markdown(advice.text)}")
                if advice.reason():
                    st.caption(f"Checked: {advice.reason()}.")
    if headline.settled:
        st.caption(settled_note([f"{checks[k].check.title} (step {checks[k].check.group})"
                                 for k in headline.settled if k in checks]))

if chain.symptom is not None:
    st.markdown(f"Symptom that starts the walk — {check_line(chain.symptom)}")

st.subheader("Reuse decomposition")
r = chain.reuse
cols = st.columns(7)  # the decomposition, then what the router says of itself
cols[0].metric("Available", ui.fmt(r.available, "ratio"), help="Longest cached match on any worker (index).")
cols[1].metric("Predicted", ui.fmt(r.predicted, "ratio"), help="What the router believed cached on its choice.")
cols[2].metric("Achieved", ui.fmt(r.achieved, "ratio"), help="What the engines reported cached.")
cols[3].metric("Routing regret", ui.fmt(r.routing_regret, "ratio"), help="Available − achieved.")
cols[4].metric("Index staleness", ui.fmt(r.index_staleness, "ratio"), help="Predicted − achieved.")
cols[5].metric("Router predicted", ui.fmt(r.router_predicted, "ratio"),
               help="The router's own belief: median share of the prompt it predicted cached on its picks "
                    "(SGLang gateway match ratio, Dynamo kv_hit_rate), from its /metrics.")
cols[6].metric("Router regret", ui.fmt(r.router_regret, "ratio"),
               help="Share of the router's picks that went to a worker with less cached overlap than the best "
                    "eligible one (Dynamo's non-max-overlap selections), from its /metrics.")
if chain.limits is not None:
    st.info(reuse_reading(r, chain.limits))

chart_url = src.prometheus_url if chain.source == "prometheus" else None
tz = charts.zone(timezone_name())


def links_line(alert: str) -> str:
    """Runbook (in-app unless a base URL is configured) and, with a Grafana configured, its panel."""
    parts = [f"[runbook]({runbook_link(alert, links)})"]
    grafana = grafana_link(alert, links)
    if grafana:
        parts.append(f"[Grafana panel]({grafana})")
    return " · ".join(parts)


def check_chart(c: CheckState) -> None:
    """The check over the chart range, with its threshold and its alert's pending/firing spans."""
    assert chart_url is not None
    try:
        points = data.sparkline(chart_url, c.check.key, range_s)
        spans = charts.spans_from_samples(data.alert_states(chart_url, c.check.alert, range_s),
                                          data.range_step_s(range_s))
    except SourceUnavailable as exc:
        st.caption(f"No chart: {exc}")
        return
    if not any(v is not None for _, v in points):
        st.caption(f"No data in the last {range_label} for this check.")
        return
    fig = charts.time_series(points, title=c.check.title, unit=c.check.unit,
                             threshold=c.threshold, op=c.check.op, spans=spans, tz=tz, range_s=range_s)
    st.plotly_chart(fig, key=f"chart-{c.check.key}", config={"displaylogo": False})


if chain.limits is not None:
    st.caption(f"Limits, `for` and severities as the exporter at {chain.limits.where} runs them (the threshold "
               "file the rules are generated from)" if chain.limits.source == "exporter" else
               f"Limits, `for` and severities from {chain.limits.where}: no exporter answered to report "
               "the ones in force.")
if not chart_url:
    st.caption("Charts over time need Prometheus: the exporter alone keeps only its current window.")

for step in chain.steps:
    with st.container(border=True, key=f"step-{step.number}"):
        st.markdown(f"### Step {step.number} — {step.title} · {shown_text(step_shown(step))}")
        st.caption(step.question)
        for c in step.checks:
            text, chart = st.columns([2, 3]) if chart_url else (st.container(), None)
            role = ("" if c.cause else " _(context)_" if c.context
                    else " _(symptom)_" if c.check.kind != "slo" else " _(SLO)_")
            text.markdown(f"{check_line(c)}{role} · _{alert_terms(c.for_s, c.severity)}_ · {links_line(c.check.alert)}")
            if chart is None:
                continue
            # Open what needs attention; the rest stays one click away, so the page stays short.
            with chart:
                if c.status == "firing" or c.pending or c.check.key == SYMPTOM_KEY:
                    check_chart(c)
                else:
                    with st.expander("Chart over time"):
                        check_chart(c)
