"""Every query the console makes, behind Streamlit caches with a TTL.

Clients are shared singletons (``st.cache_resource``); answers are cached for ``TTL_S``
(``st.cache_data``) so several pages and reruns do not hammer Prometheus or the exporter.
Failures raise :class:`~console.http_json.SourceUnavailable`, which pages show as a message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import streamlit as st

from console import promql
from console.alert_groups import alerts_from_chain
from console.alertmanager import (
    InhibitRule,
    PageAlert,
    Silence,
    fetch_alerts,
    fetch_inhibit_rules,
    fetch_silences,
)
from console.announcements import Announcement, latest
from console.chain import (
    SHARDS_KEY,
    Chain,
    Reuse,
    chain_from_exporter,
    chain_from_prometheus,
    settled_from_extremes,
    shard_note,
)
from console.culprits import Culprits, parse_culprits
from console.exporter_api import ExporterClient
from console.http_json import SourceUnavailable
from console.limits import Limits, limits_from_file, limits_from_groups
from console.liveness import PoolView, largest_sample, pool_view_from_text
from console.prom import PrometheusClient, Sample
from console.runbook_steps import Evidence, pool_changes
from console.settings import (
    ALERTMANAGER_ENV,
    DEFAULT_EXPORTER_URL,
    EXPORTER_ENV,
    PROMETHEUS_ENV,
    THRESHOLDS_ENV,
    scope_setting,
    thresholds_path,
)
from prefixscope import thresholds as threshold_file
from prefixscope.catalog import CHECKS, CHECKS_BY_ALERT, CHECKS_BY_KEY, NAMESPACE

TTL_S = 15
ROUTER_TREE_FILL = f"{NAMESPACE}_router_tree_fill_ratio"
RANGES_S = {"15 minutes": 900, "1 hour": 3600, "6 hours": 21600, "24 hours": 86400}

_REUSE_RULES = {
    "available": "cluster:prefixscope_reuse_available_tokens_per_prompt_tokens:ratio_rate5m",
    "predicted": "cluster:prefixscope_reuse_predicted_tokens_per_prompt_tokens:ratio_rate5m",
    "achieved": "cluster:prefixscope_reuse_achieved_tokens_per_prompt_tokens:ratio_rate5m",
    "router_predicted": "cluster:prefixscope_router_predicted_hit_ratio:p50_5m",
    "router_regret": "cluster:prefixscope_router_regret_selections_per_routed_requests:ratio_rate5m",
    "staleness": "cluster:prefixscope_index_staleness_tokens_per_prompt_tokens:ratio_rate5m",
}


@dataclass(frozen=True)
class Sources:
    prometheus_url: str | None
    exporter_url: str
    alertmanager_url: str | None = None


def sources() -> Sources:
    return Sources(os.environ.get(PROMETHEUS_ENV) or None, os.environ.get(EXPORTER_ENV) or DEFAULT_EXPORTER_URL,
                   os.environ.get(ALERTMANAGER_ENV) or None)


@st.cache_resource
def prometheus(url: str) -> PrometheusClient:
    """The client, its queries narrowed to the configured cluster (``--cluster``; default the only one)."""
    wanted = scope_setting()
    return PrometheusClient(url, scope=promql.Scope(wanted.label, wanted.value))


@st.cache_resource
def exporter(url: str) -> ExporterClient:
    return ExporterClient(url)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def prometheus_up(url: str) -> bool:
    return prometheus(url).ready()


def _scalar(client: PrometheusClient, expr: str) -> float | None:
    """The first sample's value: catalogue check expressions aggregate to one series."""
    samples = client.query(expr)
    values = [s.value for s in samples if s.value is not None]
    return values[0] if values else None


def signals_available(samples: list[Sample]) -> dict[str, bool]:
    """Signal -> whether any exporter reports it. With exporter shards every shard exports its own
    ``prefixscope_signal_available`` (only the shards home to a worker scrape it, shard 0 alone the
    routers): a signal is available when one of them says so, whatever order Prometheus lists them in."""
    out: dict[str, bool] = {}
    for s in samples:
        name = s.labels.get("signal", "")
        out[name] = out.get(name, False) or bool(s.value)
    return out


@st.cache_data(ttl=TTL_S, show_spinner=False)
def groups(url: str) -> dict:
    """The exporter's ``/api/v1/groups``: its chain, and the limits it runs with."""
    return exporter(url).groups()


@st.cache_data(show_spinner=False)
def file_limits(path: str) -> Limits:
    """The limits of a threshold file (read only when no exporter answers)."""
    try:
        return limits_from_file(threshold_file.load(Path(path)), Path(path).name)
    except (threshold_file.ConfigError, OSError) as exc:
        raise SourceUnavailable("threshold file", path, str(exc)) from None


def limits(src: Sources) -> tuple[Limits, list[str]]:
    """The limits in force, from the exporter; without one, from the configured threshold file
    (with a note: a deployment's own file may differ from what the console reads)."""
    try:
        return limits_from_groups(groups(src.exporter_url), src.exporter_url), []
    except SourceUnavailable as exc:
        path = thresholds_path()
        return file_limits(str(path)), [
            f"{exc} — limits below are those of {path.name} (set {THRESHOLDS_ENV} or --thresholds to the "
            "file the rules were generated from), not read from the exporter."]


# Queries of one refresh run side by side: a page waits for the slowest, not for their sum.
PARALLEL_QUERIES = 8


def _parallel(calls: Mapping[str, Callable[[], object]]) -> dict[str, object]:
    """Each call's answer by name, run on a few threads; the first SourceUnavailable is raised."""
    with ThreadPoolExecutor(max_workers=PARALLEL_QUERIES) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: f.result() for name, f in futures.items()}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def chain_from_prom(url: str, limits: Limits) -> Chain:
    """The chain from Prometheus's recording rules and alerts, judged against ``limits``; the
    checks that fire or are pending are also read over the last minute, to see which have settled."""
    client = prometheus(url)
    calls: dict[str, Callable[[], object]] = {f"value:{c.key}": partial(_scalar, client, promql.check_value(c.key))
                                              for c in CHECKS if c.key != SHARDS_KEY}
    calls.update({f"base:{c.key}": partial(_scalar, client, c.baseline) for c in CHECKS if c.baseline})
    calls.update({f"reuse:{k}": partial(_scalar, client, promql.selector(rule)) for k, rule in _REUSE_RULES.items()})
    calls.update({"signals": partial(client.query, promql.signal_available()), "alerts": client.alerts,
                  "for": client.alert_durations, "shards": partial(client.query, promql.check_value(SHARDS_KEY))})
    got = _parallel(calls)
    values = {c.key: got[f"value:{c.key}"] for c in CHECKS if c.key != SHARDS_KEY}
    # one sample per missing shard (labelled), or one for the scope: their sum is how many are missing
    shards = [s for s in got["shards"] if s.value is not None]  # type: ignore[attr-defined]
    values[SHARDS_KEY] = sum(s.value for s in shards if s.value is not None) if shards else None
    missing = tuple(sorted({s.labels["shard"] for s in shards if s.value and s.labels.get("shard")}, key=_index))
    baselines = {c.key: got[f"base:{c.key}"] for c in CHECKS if c.baseline}
    reuse = Reuse(**{k: got[f"reuse:{k}"] for k in _REUSE_RULES})
    args = (values, baselines, signals_available(got["signals"]), got["alerts"], limits, reuse, got["for"])
    now = time.time()
    found = chain_from_prometheus(*args, now)  # type: ignore[arg-type]
    # (a missing shard is a count of shards, not a windowed value: it never settles while it lasts)
    breaching = [k for k, c in found.checks().items() if (c.status == "firing" or c.pending) and k != SHARDS_KEY]
    if breaching:
        refs = {CHECKS_BY_KEY[k].threshold: t for k, lim in limits.by_check if (t := lim.threshold) is not None}
        extremes = _parallel({k: partial(_scalar, client, promql.settle_extreme(k, refs)) for k in breaching})
        found = chain_from_prometheus(*args, now, settled_from_extremes(extremes, limits))  # type: ignore[arg-type]
    return replace(found, missing_shards=missing)


def _index(shard: str) -> tuple[int, str]:
    return (int(shard), shard) if shard.isdigit() else (1 << 30, shard)


def chain_from_exp(url: str) -> Chain:
    return chain_from_exporter(groups(url), url)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def culprits(url: str, keys: tuple[str, ...]) -> dict[str, Culprits]:
    """The exporter's culprits of these checks (check key → culprits)."""
    got = (exporter(url).culprits(keys) or {}).get("checks") or {}
    return {k: c for k, raw in got.items() if (c := parse_culprits(raw)) is not None}


def chain(src: Sources) -> tuple[Chain, list[str]]:
    """The chain from Prometheus when it answers, else from the exporter; plus banner notes.

    From Prometheus, the culprits of the checks that fire or are pending come from the exporter
    (it holds the per-worker series, branches and sessions); without them the chain still stands.
    """
    notes: list[str] = []
    if src.prometheus_url:
        try:
            in_force, notes = limits(src)
            found = chain_from_prom(src.prometheus_url, in_force)
        except SourceUnavailable as exc:
            notes.append(f"{exc} — statuses below come from the exporter's own windows.")
        else:
            keys = tuple(k for k, c in found.checks().items() if c.status == "firing" or c.pending)
            if keys:
                try:
                    found = found.with_culprits(culprits(src.exporter_url, keys))
                except SourceUnavailable as exc:
                    notes.append(f"{exc} — no culprits.")
            if (note := prometheus(src.prometheus_url).scope_note) is not None:
                notes.append(note)
            return found, notes
    else:
        notes.append(f"Prometheus is not configured (set {PROMETHEUS_ENV} or --prometheus-url): statuses "
                     "come from the exporter's own windows, without charts over time or firing alerts.")
    found = chain_from_exp(src.exporter_url)
    if (note := shard_note(found.shard)) is not None:
        notes.append(note)
    return found, notes


@st.cache_data(ttl=TTL_S, show_spinner=False)
def sparkline(url: str, key: str, range_s: int) -> list[tuple[float, float | None]]:
    """The check's key number over the range (~120 points), as a ratio when it has a baseline."""
    check = CHECKS_BY_KEY[key]
    expr = f"({check.value}) / ({check.baseline})" if check.baseline else check.value
    end = time.time()
    series = prometheus(url).query_range(expr, end - range_s, end, range_step_s(range_s))
    return series[0][1] if series else []


def range_step_s(range_s: int) -> int:
    """The query step of a chart over ``range_s`` (~120 points)."""
    return max(range_s // 120, 1)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alert_states(url: str, alert: str, range_s: int) -> list[tuple[str, list[float]]]:
    """When the catalogue alert was pending or firing over the range (Prometheus's ``ALERTS``).

    ``alert`` must be a catalogue alert name: it is looked up, never pasted as typed.
    """
    check = CHECKS_BY_ALERT[alert]
    expr = f'ALERTS{{alertname="{promql.escape_label_value(check.alert)}"}}'
    end = time.time()
    client = prometheus(url)
    series = client.query_range(expr, end - range_s, end, range_step_s(range_s))
    scope = client.scope  # ALERTS keeps the scope labels of its rule: the chosen cluster's only
    return [(labels.get("alertstate", "firing"), [t for t, v in points if v]) for labels, points in series
            if scope is None or scope.matches(labels)]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alerts(url: str) -> list[dict]:
    return prometheus(url).alerts()


@st.cache_data(ttl=TTL_S, show_spinner=False)
def by_label(url: str, base: str, label: str, per_minute: bool = False) -> dict[str, float | None]:
    """One number per label value of a catalogue series (a counter as a rate per minute)."""
    expr = promql.rate_per_minute_by(base, label) if per_minute else promql.by_label(base, label)
    return {s.labels.get(label, ""): s.value for s in prometheus(url).query(expr)}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def tree(url: str, depth: int, by: str, limit: int) -> dict:
    return exporter(url).tree(depth, by, limit)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def hotspots(url: str, k: int) -> dict:
    return exporter(url).hotspots(k)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def workers(url: str) -> dict:
    return exporter(url).workers()


@st.cache_data(ttl=TTL_S, show_spinner=False)
def changes(url: str, from_ts: float | None, to_ts: float | None) -> dict:
    return exporter(url).changes(from_ts, to_ts)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def pool_view(url: str) -> PoolView:
    """The exporter's worker health series (up, router health, pool size) from its /metrics."""
    text = exporter(url).metrics_text()
    try:
        return pool_view_from_text(text)
    except ValueError as exc:
        raise SourceUnavailable(ExporterClient.source, url, f"/metrics is not the text format ({exc})") from None


@st.cache_data(ttl=TTL_S, show_spinner=False)
def router_tree_fill(url: str) -> float | None:
    """The fullest router prefix tree against its bound, from the exporter's /metrics (None: no router
    reports its tree)."""
    return largest_sample(exporter(url).metrics_text(), ROUTER_TREE_FILL)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alertmanager_alerts(url: str) -> list[PageAlert]:
    return fetch_alerts(url)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alertmanager_silences(url: str) -> list[Silence]:
    return fetch_silences(url)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alertmanager_inhibit_rules(url: str) -> list[InhibitRule]:
    return fetch_inhibit_rules(url)


def firing_alerts(src: Sources) -> tuple[list[dict], list[str]]:
    """Prometheus's alerts (firing and pending); without Prometheus, the checks the exporter finds
    firing or past their threshold (pending)."""
    if src.prometheus_url:
        try:
            return alerts(src.prometheus_url), []
        except SourceUnavailable as exc:
            notes = [f"{exc} — showing the checks the exporter itself finds firing."]
    else:
        notes = [f"Prometheus is not configured (set {PROMETHEUS_ENV} or --prometheus-url): "
                 "showing the checks the exporter itself finds firing."]
    steps = chain_from_exp(src.exporter_url).steps
    return alerts_from_chain(steps), notes


def evidence(src: Sources, found: Chain) -> Evidence:
    """What the runbook steps' conditions read: the chain's signals and breaches, its reuse and
    limits, and the exporter's pool changes and re-keys of the window (unknown when it is down)."""
    checks = found.checks()
    signals = frozenset(sig for c in checks.values() for sig in c.check.signals if sig not in c.missing)
    breaching = frozenset(k for k, c in checks.items() if c.status == "firing" or c.pending)
    try:
        ch = changes(src.exporter_url, None, None)
    except SourceUnavailable:
        ch = None
    rekeys = None if ch is None else sum(int(r.get("rekeys") or 0) for r in ch.get("rekeyed_segments") or [])
    culprit_workers = max((len(c.culprits.workers) for c in checks.values() if c.culprits is not None), default=0)
    target = found.limits.threshold("prefix_hit_rate_total") if found.limits is not None else None
    try:
        tree_fill = router_tree_fill(src.exporter_url) if "prefix_tree_walk_latency" in breaching else None
    except SourceUnavailable:
        tree_fill = None
    return Evidence(signals=signals, breaching=breaching, router_tree_fill=tree_fill,
                    pool_changes=None if ch is None else pool_changes(ch.get("pool_changes") or []),
                    rekeys=rekeys, available=found.reuse.available, achieved=found.reuse.achieved,
                    hit_target=target, culprit_workers=culprit_workers)


@st.cache_data(ttl=5, show_spinner=False)
def announcements(path: str) -> list[Announcement]:
    """The fleet's newest announcements (newest first); read often, the file is small."""
    return latest(Path(path))
