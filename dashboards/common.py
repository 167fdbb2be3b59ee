"""prefixscope's dashboard house style: panels, rows, variables and the finalize pass.

All direct grafanalib use lives here, so the ``*.dashboard.py`` files hold layout only and a
switch away from grafanalib rewrites one module. Known grafanalib 0.7.1 defects are avoided
rather than patched after the fact: no GaugePanel (its threshold base is the string "null"),
no legacy Heatmap, and every panel and target names its datasource explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import attr
from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

from dashboards import queries as q
from dashboards.drawing import Drawing, Drawn
from prefixscope.catalog import BURN_WINDOWS, Check
from prefixscope.wording import threshold_text

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TAG = "prefixscope"
PANEL_HEIGHT = 8
GRID_WIDTH = 24
OK, BAD = "green", "red"

# Grafana units per catalogue unit.
UNITS = {"ratio": "percentunit", "seconds": "s", "usd": "currencyUSD", "per_minute": "none",
         "per_second": "reqps", "ratio_to_baseline": "x", "ratio_to_budget": "x", "ratio_to_peers": "x", "blocks": "none", "tokens": "none",
         "depth": "none", "batches": "none", "": "none"}

def target(expr: str, legend: str = "", instant: bool = False, table: bool = False) -> g.Target:
    return g.Target(expr=expr, legendFormat=legend, instant=instant, datasource=DATASOURCE,
                    format=g.TABLE_TARGET_FORMAT if table else g.TIME_SERIES_TARGET_FORMAT)


def _with_ref_ids(targets: list[g.Target]) -> list[g.Target]:
    return [attr.evolve(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]


def _steps(base: str, limits: list[tuple[float, str]]) -> dict:
    # Grafana's base step has value null ("from minus infinity").
    steps = [{"color": base, "value": None}] + [{"color": c, "value": v} for v, c in limits]
    return {"fieldConfig": {"defaults": {"thresholds": {"mode": "absolute", "steps": steps}}}}


def check_steps(check: Check, drawing: Drawing) -> dict:
    """Threshold steps drawn on a check's panel, from the threshold file being drawn with."""
    value = drawing.entry(check).value
    if check.op == "<":
        return _steps(BAD, [(value, OK)])
    return _steps(OK, [(value, BAD)])


def runbook_link(alert: str, drawing: Drawing) -> g.DataLink:
    return g.DataLink(title=f"Runbook: {alert}", linkUrl=drawing.runbook_url(alert), isNewTab=True)


def check_description(check: Check, drawing: Drawing) -> str:
    entry = drawing.entry(check)
    word = "below" if check.op == "<" else "above"
    limit = threshold_text(check, entry.value)
    if check.baseline:
        limit = f"{entry.value:g} × baseline (the panel plots value ÷ baseline)"
    missing = ", ".join(check.signals) or "none"
    return (f"{check.meaning} Alert **{check.alert}** ({entry.severity}) fires {word} {limit} for "
            f"{entry.for_}. Needs signals: {missing}; without them the panel shows no data, never zero.\n\n"
            f"Runbook: [{check.alert}]({drawing.runbook_url(check.alert)})")


def timeseries(title: str, targets: list[g.Target], unit: str = "none", description: str = "",
               steps: dict | None = None, links: list[g.DataLink] | None = None, stack: bool = False) -> g.TimeSeries:
    return g.TimeSeries(
        title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
        unit=UNITS.get(unit, unit), links=links or [], legendDisplayMode="list",
        thresholdsStyleMode="line+area" if steps else "off", fillOpacity=10, spanNulls=False,
        stacking={"mode": "normal" if stack else "none"},
        extraJson=steps or _steps("text", []),
    )


def stat(title: str, targets: list[g.Target], unit: str = "none", description: str = "",
         steps: dict | None = None, links: list[g.DataLink] | None = None) -> g.Stat:
    extra = steps or _steps("text", [])
    # A missing series is "no data", not 0: keep Grafana's empty-state text explicit.
    extra = {**extra, "fieldConfig": {"defaults": {**extra["fieldConfig"]["defaults"], "noValue": "no data"}}}
    return g.Stat(title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
                  format=UNITS.get(unit, unit), reduceCalc="lastNotNull", graphMode="area",
                  colorMode="value", links=links or [], extraJson=extra)


def bargauge(title: str, targets: list[g.Target], unit: str = "none", description: str = "",
             steps: dict | None = None, maximum: float | None = None) -> g.BarGauge:
    extra: dict = dict(steps or _steps("blue", []))
    if maximum is not None:
        extra["fieldConfig"]["defaults"]["max"] = maximum
    extra["fieldConfig"]["defaults"]["min"] = 0
    # grafanalib's BarGauge omits fieldConfig.overrides, which Grafana's schema requires.
    extra["fieldConfig"]["overrides"] = []
    return g.BarGauge(title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
                      format=UNITS.get(unit, unit), orientation=g.ORIENTATION_HORIZONTAL,
                      displayMode=g.GAUGE_DISPLAY_MODE_GRADIENT, calc="lastNotNull", extraJson=extra)


def table(title: str, targets: list[g.Target], description: str = "") -> g.Table:
    return g.Table(title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
                   transformations=[{"id": "merge", "options": {}}],
                   extraJson={"fieldConfig": {"defaults": {"custom": {"align": "auto"}}}})


def check_panel(check: Check, drawing: Drawing) -> g.TimeSeries:
    """One diagnosis-chain check: its value over time with its threshold drawn, linked to its runbook;
    the panel its alert links to."""
    unit = "ratio_to_baseline" if check.baseline else check.unit
    return drawing.shows(timeseries(check.title, [target(q.check_value(check, drawing.thresholds), check.key)],
                                    unit=unit, description=check_description(check, drawing),
                                    steps=check_steps(check, drawing), links=[runbook_link(check.alert, drawing)]),
                         check.alert)


def slo_burn_panel(check: Check, drawing: Drawing) -> g.TimeSeries:
    """An SLO's burn rate (error ratio ÷ budget) over each burn window, with the pairs' factors drawn."""
    assert check.slo is not None
    entry = drawing.entry(check)
    budget = round(1.0 - entry.value, 9)
    windows = sorted({w for b in BURN_WINDOWS for w in (b.long, b.short)}, key=lambda w: (w[-1], int(w[:-1])))
    targets = [target(f"{q.rule(check.slo.error_ratio_rule(check.key, w))} / {budget:g}", f"burn rate {w}")
               for w in windows]
    limits = sorted((entry.burn_rates or {}).values())
    colors = ["orange", BAD]
    pairs = ", ".join(f"{b.pair} ({b.severity}): {b.long} and {b.short} above "
                      f"{(entry.burn_rates or {}).get(b.pair, 0):g}" for b in BURN_WINDOWS)
    panel = timeseries(f"Error-budget burn: {check.title.removeprefix('SLO: ')}", targets, unit="ratio_to_baseline",
                       description=(f"Burn rate = error ratio ÷ error budget ({budget:.0%}); 1 spends the budget "
                                    f"exactly over the SLO period. Alert {check.alert} fires per pair when both of "
                                    f"its windows burn faster than its factor — {pairs}."),
                       steps=_steps(OK, list(zip(limits, colors, strict=False))),
                       links=[runbook_link(check.alert, drawing)])
    # The burn panel, drawn after the SLO's value panel in its row, is where the alert links.
    return drawing.shows(panel, check.alert)


def _variables(scope: Sequence[str]) -> g.Templating:
    info = q.metric("worker_info")
    models = q.metric("prefix_cache_queried_tokens")
    build = q.metric("exporter_build_info")
    by_node = '{node=~"$node"}'

    def query_var(name: str, label: str, query: str) -> g.Template:
        return g.Template(name=name, label=label, query=query, dataSource=DATASOURCE, type="query",
                          includeAll=True, multi=True, allValue=".*", default="$__all",
                          refresh=g.REFRESH_ON_TIME_RANGE_CHANGE)

    # One variable per scope label (the clusters one Prometheus watches), each narrowed by the ones
    # before it, from the series every exporter exports; "All" also matches series without the label.
    scopes = [query_var(label, label.replace("_", " ").capitalize(),
                        f"label_values({q.select_scope(build, scope[:i])}, {label})")
              for i, label in enumerate(scope)]
    return g.Templating(list=[
        g.Template(name="datasource", label="Data source", query="prometheus", type="datasource", default="Prometheus"),
        *scopes,
        query_var("model", "Model", f"label_values({q.select_scope(models, scope)}, model)"),
        query_var("node", "Node", f"label_values({q.select_scope(info, scope)}, node)"),
        # Workers come from the topology; with no topology loaded "All" still matches every worker.
        query_var("worker", "Worker", f"label_values({q.select_scope(info + by_node, scope)}, worker)"),
    ])


def _scoped(panel: g.Panel, scope: Sequence[str]) -> g.Panel:
    """The panel with every query narrowed to the scope variables and kept apart by scope."""
    targets = getattr(panel, "targets", None)
    if not targets or not scope:
        return panel
    return attr.evolve(panel, targets=[attr.evolve(t, expr=q.scoped(t.expr, scope)) for t in targets])


def row(title: str, panels: list[g.Panel]) -> list[g.Panel]:
    """A row header followed by its panels laid out left to right, wrapping at four per line."""
    return [g.RowPanel(title=title, collapsed=False), *panels]


def _layout(panels: list[g.Panel]) -> list[g.Panel]:
    out, y, line = [], 0, []

    def flush() -> None:
        nonlocal y, line
        if not line:
            return
        width = GRID_WIDTH // len(line)
        for i, p in enumerate(line):
            out.append(attr.evolve(p, gridPos=g.GridPos(h=PANEL_HEIGHT, w=width, x=i * width, y=y)))
        y += PANEL_HEIGHT
        line = []

    for p in panels:
        if isinstance(p, g.RowPanel):
            flush()
            out.append(attr.evolve(p, gridPos=g.GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
            y += 1
        else:
            line.append(p)
            if len(line) == 4:
                flush()
    flush()
    return out


def finalize(title: str, source_file: str, panels: list[g.Panel], description: str, drawing: Drawing) -> Drawn:
    """Stable uid from the file name, tags, links, variables, layout and panel ids; the panel of
    each alert the panels show."""
    uid = "prefixscope-" + Path(source_file).name.removesuffix(".dashboard.py").replace("_", "-")
    scope = drawing.thresholds.scope_labels
    dashboard = g.Dashboard(
        title=title, uid=uid, description=description, tags=[TAG], timezone="browser",
        schemaVersion=SCHEMA_VERSION, refresh="30s", time=g.Time("now-1h", "now"),
        templating=_variables(scope), panels=_layout([_scoped(p, scope) for p in panels]), editable=False,
        links=[g.DashboardLink(type="dashboards", tags=[TAG], asDropdown=True, title="prefixscope",
                               includeVars=True, keepTime=True),
               g.DashboardLink(type="link", title="Runbooks", icon="doc", targetBlank=True,
                               uri=drawing.thresholds.runbook_url_base + "README.md")],
    ).auto_panel_ids()
    return Drawn(dashboard, drawing.alert_panels(panels, dashboard))


def to_json(dashboard: g.Dashboard) -> str:
    return json.dumps(dashboard.to_json_data(), cls=DashboardEncoder, sort_keys=True, indent=2,
                      ensure_ascii=False) + "\n"
