"""Named PromQL for the dashboards, built from catalogue names (never spelled out by hand).

Selectors use the dashboard variables: ``$model`` on model-labelled series, ``$worker`` on
worker-labelled ones (the ``$node`` variable narrows ``$worker`` through the topology). Every
query is finally :func:`scoped`: each series and recording rule selects the scope labels'
variables (``$cluster``) and each aggregation keeps the scope labels, so one Prometheus watching
several clusters shows the chosen ones apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixscope.catalog import (
    METRICS_BY_NAME,
    NAMESPACE,
    RULES_BY_NAME,
    Check,
    add_matchers,
    configure,
    scope_expr,
)
from prefixscope.thresholds import Thresholds


def scope_selector(labels: Sequence[str]) -> str:
    """The matchers of the scope labels' dashboard variables: ``cluster=~"$cluster"``."""
    return ", ".join(f'{label}=~"${label}"' for label in labels)


def select_scope(expr: str, labels: Sequence[str]) -> str:
    """Every series and recording rule in ``expr`` narrowed to the scope variables' values."""
    return add_matchers(expr, scope_selector(labels))


def scoped(expr: str, labels: Sequence[str]) -> str:
    """A panel's query as the dashboard runs it: narrowed to the scope variables, every aggregation
    keeping the scope labels (``sum by (cluster, …)``: one line per cluster when several are chosen)."""
    return select_scope(scope_expr(expr, labels), labels)


def windowed(expr: str, th: Thresholds) -> str:
    """A catalogue expression with the configured windows (see ``catalog.configure``)."""
    return configure(expr, th.window, th.baseline_window)


def metric(name: str) -> str:
    """The sample name of catalogue metric ``prefixscope_<name>`` (``_total`` for counters)."""
    return METRICS_BY_NAME[f"{NAMESPACE}_{name}"].sample_name


def rule(name: str) -> str:
    if name not in RULES_BY_NAME:
        raise KeyError(f"{name} is not a recording rule in prefixscope/catalog.py")
    return name


def _sel(name: str) -> str:
    labels = METRICS_BY_NAME[f"{NAMESPACE}_{name}"].labels
    parts = []
    if "model" in labels:
        parts.append('model=~"$model"')
    if "worker" in labels:
        parts.append('worker=~"$worker"')
    return "{" + ", ".join(parts) + "}" if parts else ""


def series(name: str) -> str:
    """A catalogue series with the dashboard's variable selectors applied."""
    return metric(name) + _sel(name)


def rate(name: str, window: str = "$__rate_interval") -> str:
    return f"rate({series(name)}[{window}])"


def ratio_by(num: str, den: str, by: str, over: str) -> str:
    """Numerator and denominator summed before dividing, as the recording rules do."""
    return f"sum by ({by}) ({rate(num, over)}) / sum by ({by}) ({rate(den, over)})"


def quantile(q: float, name: str, by: str = "", over: str | None = None, rated: bool = True) -> str:
    labels = ", ".join(["le", *[b for b in by.split(",") if b]])
    if rated and over is None:
        raise ValueError(f"quantile of {name}: a rated quantile needs its window")
    inner = f"rate({metric(name)}_bucket{_sel(name)}[{over}])" if rated else f"{metric(name)}_bucket{_sel(name)}"
    return f"histogram_quantile({q}, sum by ({labels}) ({inner}))"


def check_value(check: Check, th: Thresholds) -> str:
    """What a check's panel plots: its value, or value ÷ baseline for relative thresholds."""
    if check.baseline:
        return f"({windowed(check.value, th)}) / ({windowed(check.baseline, th)})"
    return windowed(check.value, th)


def offload_hit_tokens_rate(by: str = "") -> str:
    """Cached prompt tokens per second served by tiers other than the GPU (host, disk, p2p, …)."""
    sel = series("prefix_cache_tier_hit_tokens").replace("{", '{tier!="device", ', 1)
    return f"sum{f' by ({by})' if by else ''} (rate({sel}[$__rate_interval]))"


def offload_resident_blocks(by: str = "") -> str:
    """Blocks the offload tiers hold (every medium but the GPU), from KV events."""
    sel = series("worker_medium_resident_blocks").replace("{", '{medium!="GPU", ', 1)
    return f"sum{f' by ({by})' if by else ''} ({sel})"


def signal_available(signals: tuple[str, ...]) -> str:
    names = "|".join(signals)
    return f'{metric("signal_available")}{{signal=~"{names}"}}'


# ---- what the router says of its own decisions and index ----------------------------------------
def router_predicted_hit_ratio_mean(over: str) -> str:
    """Per router, the mean share of the prompt it predicted cached on its picks (its histogram's
    sum ÷ count): the router's belief, to read against the engines' achieved hit rate."""
    name = metric("router_predicted_hit_ratio")
    return f"sum by (router) (rate({name}_sum[{over}])) / sum by (router) (rate({name}_count[{over}]))"


def router_followups_by_outcome() -> str:
    """Keyed follow-ups per second the router kept, moved off a healthy worker (collision) or off an
    unhealthy one (migration), by router and policy."""
    return f"sum by (router, policy, outcome) ({rate('router_sticky_followups')})"


def router_tree_fill() -> str:
    """Per router, its largest prefix tree against the bound its eviction keeps each tree under."""
    return f"max by (router) ({series('router_tree_fill_ratio')})"


def router_index_faults() -> str:
    return f"sum by (router, kind) ({rate('router_kv_index_faults')})"
