"""Evaluate every catalogue check on the exporter's own windows, and walk the diagnosis chain.

Each check's value is the catalogue's PromQL (or the recording rule it names) computed in
Python over the state's windows — numerator and denominator summed over the window before
dividing, quantiles on the same bucket layouts — so /api/v1/groups agrees with Prometheus.
Status is instantaneous (``for`` durations are Prometheus's business). A check whose signal
is missing, or that has no data in the window, is ``not_instrumented``: never 0, never ok.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exporter.core import worker_outliers
from exporter.core.metric_store import CLASS_LABELS, HEALTHY_HISTOGRAM
from exporter.core.state import ClusterState, Series
from exporter.core.windows import bucket_counts, histogram_quantile
from prefixscope import catalog, diagnosis
from prefixscope.diagnosis import Status
from prefixscope.durations import parse_duration
from prefixscope.thresholds import threshold_value

_RATIO = re.compile(r"^sum \(rate\((\w+)_total(\{[^}]*\})?\[\w+\]\)\) / sum \(rate\((\w+)_total(\{[^}]*\})?\[\w+\]\)\)$")
_RATE_QUANTILE = re.compile(r"^histogram_quantile\(([\d.]+), sum by \(le\) \(rate\((\w+)_bucket(\{[^}]*\})?\[(\w+)\]\)\)\)$")
_GAUGE_QUANTILE = re.compile(r"^histogram_quantile\(([\d.]+), sum by \(le\) \((\w+)_bucket\)\)$")
_PER_MINUTE = re.compile(r"^sum\(rate\((\w+)_total\[\w+\]\)\) \* 60$")
_INCREASE = re.compile(r"^sum\(increase\((\w+)_total\[\w+\]\)\)$")
_RATE = re.compile(r"^sum\(rate\((\w+)_total\[\w+\]\)\)$")
_AGG = re.compile(r"^(avg|min|max)\(([\w:]+)\)$")
_AGE = re.compile(r"^max\(time\(\) - (\w+)\)$")
# per-worker gauges, pooled by worker (sum of the family shards' parts / max of one scraped value)
_PER_WORKER_RATIO = re.compile(r"^sum by \(worker\) \((\w+)\) / on \(worker\) max by \(worker\) \((\w+)\)$")
_PER_WORKER_RATE_RATIO = re.compile(r"^sum by \(worker\) \(rate\((\w+)_total\[\w+\]\)\) / "
                                    r"sum by \(worker\) \(rate\((\w+)_total\[\w+\]\)\)$")
# a per-worker series kept only where another one is past a threshold (0 elsewhere)
_GATED = re.compile(r"^([\w:]+) \* on \(worker\) \(([\w:]+) > bool threshold\((\w+)\)\)$")
_MATCHER = re.compile(r'(\w+)="([^"]*)"')
# the share of a gauge's series (one per worker) whose age is past a threshold
_STALE_SHARE = re.compile(r"^sum\(\(time\(\) - (\w+)\) > bool threshold\((\w+)\)\) / count\((\w+)\)$")
_ABSENT = re.compile(r"^absent\((\w+)\) or vector\(0\)$")
# Quantiles kept per label set: over the window ([5m]) or over the baseline ([1d] offset 5m, the
# long window ending one window ago) — the catalogue's default ranges stand for the configured ones.
_QUANTILE_BY = re.compile(r"^histogram_quantile\(([\d.]+), sum by \(le, ([\w, ]+)\) \(rate\((\w+)_bucket"
                          r"\[(\w+)\]( offset \w+)?\)\)\)$")
# The healthy-window baseline: the quantile of a recorded rate averaged over the baseline window
# (the windows no check breached), or where a class has none, the plain baseline (a _QUANTILE_BY).
_HEALTHY_QUANTILE_OR = re.compile(r"^histogram_quantile\(([\d.]+), sum by \(le, ([\w, ]+)\) \(avg_over_time\("
                                  r"([\w:]+)\[\w+\] offset \w+\)\)\) or (.+)$")
_RULE_RATIO = re.compile(r"^([\w:]+) / ([\w:]+)$")
# the first value where it exists and is not NaN (``>= 0`` drops a 0/0 ratio), else the second
_FIRST_OR = re.compile(r"^\((.+) >= 0\) or \((.+)\)$")
# a quantile kept only where its window observed something (catalog._observed): NaN dropped, which
# is what the exporter's own quantiles do (a label set with no observation has none)
_OBSERVED = re.compile(r"^\((.+)\) >= 0$")


@dataclass
class CheckResult:
    check: catalog.Check
    value: float | None
    threshold: float
    baseline: float | None
    status: Status
    missing_signals: list[str] = field(default_factory=list)
    # critical, warning or info (alerts/thresholds.yaml): an info check gives context, never the verdict.
    severity: str = "warning"


@dataclass
class Evaluation:
    evaluated_at: float
    window_s: float
    signals: dict[str, bool]
    results: dict[str, CheckResult]
    step_status: dict[int, Status]
    verdict: dict[str, Any] | None
    reuse: dict[str, float | None]


class _Evaluator:
    """Computes a catalogue expression on the state; None means no data."""

    def __init__(self, state: ClusterState, series: Series, now: float) -> None:
        self.state, self.series, self.now = state, series, now

    def value(self, expr: str) -> float | None:
        rule = catalog.RULES_BY_NAME.get(expr)
        if rule is not None:
            expr = rule.expr
        st = self.state
        if m := _FIRST_OR.match(expr):
            first = self.value(m[1])
            return first if first is not None and first >= 0 else self.value(m[2])
        if m := _RATIO.match(expr):
            num = st.store.window_counter(m[1], _label_filter(m[1], m[2]) if m[2] else None)
            den = st.store.window_counter(m[3], _label_filter(m[3], m[4]) if m[4] else None)
            return (num or 0.0) / den if den else None
        if m := _RATE_QUANTILE.match(expr):
            window = parse_duration(m[4])
            where = _label_filter(m[2], m[3]) if m[3] else None
            got = st.store.window_buckets(m[2], window, where)
            return histogram_quantile(float(m[1]), got[0], got[1]) if got else None
        if m := _GAUGE_QUANTILE.match(expr):
            metric = catalog.METRICS_BY_NAME[m[2]]
            obs = self.series.gaugehistograms.get(m[2])
            if not obs or metric.buckets is None:
                return None
            counts, _ = bucket_counts(metric.buckets, obs)
            return histogram_quantile(float(m[1]), metric.buckets, counts)
        if m := _PER_MINUTE.match(expr):
            total = st.store.window_counter(m[1])
            if total is None and st.store.cum.counters.get(m[1]):
                total = 0.0  # the counter is exported and did not move: Prometheus reads a rate of 0
            return None if total is None else total / st.window_s * 60.0
        if m := _INCREASE.match(expr):
            if m[1] in st.health_increases.names:  # the exporter's own health counters
                return st.health_increases.increase(m[1])
            return st.store.window_counter(m[1])  # a counter the state keeps in its windows
        if m := _RATE.match(expr):
            inc = st.health_increases.increase(m[1])
            return None if inc is None else inc / st.window_s
        if expr == catalog.SHARDS_MISSING_BY_SHARD:
            return self._shards_missing()
        if m := _ABSENT.match(expr):
            # The exporter evaluating its own checks is exporting its build info.
            return 0.0 if self.series.gauges.get(m[1]) else 1.0
        if m := _AGE.match(expr):
            vals = self.series.gauges.get(m[1], {}).values()
            return max(self.now - v for v in vals) if vals else None
        if m := _AGG.match(expr):
            vals = list(self._vector(m[2]).values())
            if not vals:
                return None
            return {"avg": sum(vals) / len(vals), "min": min(vals), "max": max(vals)}[m[1]]
        raise ValueError(f"the exporter cannot evaluate {expr!r}: extend exporter/core/checks.py")

    def _shards_missing(self) -> float | None:
        """The count the shards expect minus those reporting. One exporter sees only its own series:
        unsharded, nothing is missing; one shard of several cannot tell whether its peers run."""
        plan = self.series.gauges.get(f"{catalog.NAMESPACE}_exporter_shards", {})
        if not plan:
            return None
        expected = max(plan.values())
        if len(plan) == 1 and expected > 1:
            return None
        return max(0.0, expected - len(plan))

    def _vector(self, name: str) -> dict[tuple, float]:
        rule = catalog.RULES_BY_NAME.get(name)
        if rule is not None and (m := _PER_WORKER_RATIO.match(rule.expr)):
            num, den = self.series.gauges.get(m[1], {}), self.series.gauges.get(m[2], {})
            return {k: v / den[k] for k, v in num.items() if den.get(k)}
        if rule is not None and (m := _PER_WORKER_RATE_RATIO.match(rule.expr)):
            num, den = self.state.store.window_by_worker(m[1]), self.state.store.window_by_worker(m[2])
            # a worker whose stream exists but stored nothing in the window thrashed nothing: 0
            exported = {labels[0] for labels in self.state.store.cum.counters.get(m[2], {})}
            out = {(w,): num.get(w, 0.0) / d for w, d in den.items() if d}
            out.update({(w,): 0.0 for w in exported if (w,) not in out})
            return out
        if rule is not None and (m := _GATED.match(rule.expr)):
            values, gate = self._vector(m[1]), self._vector(m[2])
            limit = self.state.thresholds.checks[m[3]].value
            return {k: v if gate[k] > limit else 0.0 for k, v in values.items() if k in gate}
        if rule is not None and (m := _RULE_RATIO.match(rule.expr)):
            # one-to-one matching on the same labels, as PromQL's `/` between two rules
            num, den = self._vector(m[1]), self._vector(m[2])
            return {k: v / den[k] for k, v in num.items() if den.get(k)}
        if rule is not None and (m := _QUANTILE_BY.match(_unobserved(rule.expr))):
            return self._quantiles_by(float(m[1]), [b.strip() for b in m[2].split(",")], m[3], baseline=bool(m[5]))
        if name == worker_outliers.RULE:
            return {(w,): v for w, v in worker_outliers.peer_ratios(self.state.store, self.state.thresholds).items()}
        if rule is not None and (m := _STALE_SHARE.match(rule.expr)) and m[1] == m[3]:
            stamps = self.series.gauges.get(m[1], {}).values()
            limit = self.state.thresholds.checks[m[2]].value
            return {(): sum(self.now - v > limit for v in stamps) / len(stamps)} if stamps else {}
        if rule is not None and (m := _HEALTHY_QUANTILE_OR.match(rule.expr)):
            return self._healthy_quantiles(float(m[1]), [b.strip() for b in m[2].split(",")], m[3], m[4])
        if rule is not None and (m := catalog.BUDGET_REF.fullmatch(rule.expr)):
            return self._over_budget(m[1], m[2])
        return self.series.gauges.get(name, {})

    def _healthy_quantiles(self, q: float, by: list[str], healthy_rule: str, plain: str) -> dict[tuple, float]:
        """The healthy-window baseline per class, the plain one (``plain``) for the classes without."""
        fallback = _QUANTILE_BY.match(plain)
        metric = HEALTHY_HISTOGRAM
        if fallback is None or f"{metric}_bucket" not in catalog.RULES_BY_NAME[healthy_rule].expr \
                or tuple(by) != CLASS_LABELS:
            raise ValueError(f"the exporter cannot evaluate the baseline over {healthy_rule}: extend exporter/core/checks.py")
        out = self._quantiles_by(float(fallback[1]), [b.strip() for b in fallback[2].split(",")], fallback[3],
                                 baseline=True)
        rows = self.state.store.healthy_baseline_rows(metric)
        meta = catalog.METRICS_BY_NAME[metric]
        for key, counts in (rows or {}).items():  # without thresholds the store keeps no healthy windows
            value = histogram_quantile(q, meta.buckets or (), counts)
            if value is not None:
                out[key] = value
        return out

    def _over_budget(self, rule_name: str, key: str) -> dict[tuple, float]:
        """A per-prompt-class rule over the budget of each class (the threshold entry ``key``)."""
        budgets = self.state.thresholds.checks[key].budgets or {}
        m = _QUANTILE_BY.match(catalog.RULES_BY_NAME[rule_name].expr)
        by = [b.strip() for b in m[2].split(",")] if m else []
        if "prompt_class" not in by:
            raise ValueError(f"the exporter cannot evaluate budgets of {rule_name}: extend exporter/core/checks.py")
        at = by.index("prompt_class")
        return {k: v / budgets[k[at]] for k, v in self._vector(rule_name).items() if budgets.get(k[at])}

    def _quantiles_by(self, q: float, by: list[str], metric: str, baseline: bool) -> dict[tuple, float]:
        """histogram_quantile(q, sum by (le, <by>) (rate(metric_bucket[range]))) per label set."""
        store = self.state.store
        rows = store.baseline_rows(metric) if baseline else store.window_rows(metric)
        meta = catalog.METRICS_BY_NAME[metric]
        if not rows or meta.buckets is None:
            return {}
        idx = [meta.labels.index(b) for b in by]
        grouped: dict[tuple, list[int]] = {}
        for labels, row in rows.items():
            key = tuple(labels[i] for i in idx)
            acc = grouped.setdefault(key, [0] * len(row))
            for i, c in enumerate(row):
                acc[i] += c
        out = {}
        for key, counts in grouped.items():
            value = histogram_quantile(q, meta.buckets, counts)
            if value is not None:
                out[key] = value
        return out


def _unobserved(expr: str) -> str:
    """The quantile inside ``(quantile) >= 0``; any other expression as it is."""
    m = _OBSERVED.match(expr)
    return m[1] if m else expr


def _label_filter(metric: str, matchers: str) -> Callable[[tuple[str, ...]], bool]:
    names = catalog.METRICS_BY_NAME[metric].labels
    wanted = [(names.index(k), v) for k, v in _MATCHER.findall(matchers)]
    return lambda labels: all(labels[i] == v for i, v in wanted)


def evaluate(state: ClusterState, now: float | None = None) -> Evaluation:
    """All checks, per-step status, the verdict and the reuse decomposition, in one pass."""
    return state.snapshot_for(lambda st: _evaluate(st, now))


def _evaluate(state: ClusterState, now: float | None) -> Evaluation:
    series = state.series()
    t = state.clock() if now is None else now
    ev = _Evaluator(state, series, t)
    signals = series.signals
    results: dict[str, CheckResult] = {}
    for check in catalog.CHECKS:
        missing = [s for s in check.signals if not signals.get(s, False)]
        thr = threshold_value(state.thresholds, check)
        value = baseline = None
        if not missing:
            value = ev.value(check.value)
            if check.baseline is not None:
                baseline = ev.value(check.baseline)
        limit = thr * baseline if check.baseline is not None and baseline is not None else (
            None if check.baseline is not None else thr)
        status = diagnosis.check_status(check.op, value, limit)
        results[check.key] = CheckResult(check, value, thr, baseline, status, missing,
                                         state.thresholds.checks[check.threshold].severity)
    # The rule (symptom and SLOs colour no step, the first firing cause step is the verdict)
    # lives in prefixscope.diagnosis, shared with the console.
    statuses = {key: r.status for key, r in results.items()}
    context = diagnosis.context_checks(state.thresholds.severities)
    found = diagnosis.verdict(statuses, context)
    verdict = found.as_dict() if found is not None else None
    return Evaluation(t, state.window_s, signals, results, diagnosis.step_statuses(statuses, context), verdict,
                      _reuse(state))


def _reuse(state: ClusterState) -> dict[str, float | None]:
    """Window sums of the reuse decomposition (None where no record carried the field)."""
    p = catalog.NAMESPACE

    def w(name: str) -> float | None:
        return state.store.window_counter(f"{p}_{name}")

    prompt, avail, pred, ach = (w("request_prompt_tokens"), w("reuse_available_tokens"),
                                w("reuse_predicted_tokens"), w("reuse_achieved_tokens"))
    return {
        "prompt_tokens": prompt,
        "available_tokens": avail,
        "predicted_tokens": pred,
        "achieved_tokens": ach,
        "routing_regret_tokens": max(0.0, avail - ach) if avail is not None and ach is not None else None,
        "index_staleness_tokens": w("index_staleness_tokens"),
        # what the routers say of themselves: their predicted share (median over their picks) and
        # their regret (picks below the best overlap) against the requests they routed
        "router_predicted_hit_ratio_p50": _window_quantile(state, f"{p}_router_predicted_hit_ratio", 0.5),
        "router_regret_selections": w("router_regret_selections"),
        "router_routed_requests": w("router_routed_requests"),
    }


def _window_quantile(state: ClusterState, metric: str, q: float) -> float | None:
    got = state.store.window_buckets(metric)
    return histogram_quantile(q, got[0], got[1]) if got else None


# ---- the short window: has a check settled? ----------------------------------------------------
class _RecentState:
    """The state as the evaluator reads it, with the window narrowed to its last ``span_s``
    seconds: counters and histograms from the slots since then, health increases since then.
    Gauges are instantaneous either way. Everything else is the state's own."""

    def __init__(self, state: ClusterState, span_s: float, now: float) -> None:
        self._state = state
        self.window_s = span_s
        self.store = state.store.recent(now - span_s)
        self.health_increases = _RecentIncreases(state, now - span_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class _RecentIncreases:
    def __init__(self, state: ClusterState, since: float) -> None:
        self._increases, self._since = state.health_increases, since
        self.names = state.health_increases.names  # which counters are the exporter's own health ones

    def increase(self, name: str) -> float | None:
        return self._increases.increase_since(name, self._since)


def recent_statuses(state: ClusterState, span_s: float = diagnosis.SETTLE_WINDOW_S,
                    now: float | None = None) -> dict[str, Status]:
    """Each check's status over the last ``span_s`` seconds of its window (prefixscope.diagnosis:
    SETTLE_WINDOW), against the limit in force; ``not_instrumented`` where nothing was measured."""
    return state.snapshot_for(lambda st: _recent_statuses(st, span_s, now))


def _recent_statuses(state: ClusterState, span_s: float, now: float | None) -> dict[str, Status]:
    series = state.series()
    t = state.clock() if now is None else now
    recent = _RecentState(state, span_s, t)
    ev = _Evaluator(recent, series, t)  # type: ignore[arg-type]
    full = _Evaluator(state, series, t)  # baselines stay the long window's, as the alert reads them
    out: dict[str, Status] = {}
    for check in catalog.CHECKS:
        if any(not series.signals.get(s, False) for s in check.signals):
            out[check.key] = diagnosis.NOT_INSTRUMENTED
            continue
        thr = threshold_value(state.thresholds, check)
        value = ev.value(check.value)
        if check.baseline is not None:
            base = full.value(check.baseline)
            limit = None if base is None else thr * base
        else:
            limit = thr
        out[check.key] = diagnosis.check_status(check.op, value, limit)
    return out
