"""Generate promtool unit tests: for every alert, one case where it fires and one where it stays silent.

Input series are synthesised from the *shape* of each check's PromQL (counter ratio, histogram
quantile, gauge aggregate, staleness, increase), so a new catalogue check with a new shape
stops generation with a message naming it instead of silently going untested. Expected
annotations are rendered with :mod:`prefixscope.units`; promtool compares them with the real
template engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from alerts.rules import WATCHDOG, alert_rules, watchdog_rule
from prefixscope.catalog import (
    BUDGET_REF,
    BURN_WINDOWS,
    CHECKS,
    METRICS_BY_NAME,
    PROMPT_CLASSES,
    RULES_BY_NAME,
    SHARDS_MISSING_BY_SHARD,
    Check,
)
from prefixscope.durations import parse_duration
from prefixscope.thresholds import Thresholds
from prefixscope.units import render_value_template

INTERVAL_S = 60
TAIL_MINUTES = 10  # evaluate this long after `for` has elapsed: rate windows are full by then
BUCKET_STEP = 10  # observations per minute landing in the chosen bucket


class UnsupportedShape(ValueError):
    pass


@dataclass
class Synth:
    series: list[dict]
    value: float
    eval_min: int | None = None  # the shape needs this evaluation time (else `for` + TAIL_MINUTES)
    labels: dict[str, str] = field(default_factory=dict)  # labels the alert carries beyond the rule's


def _minutes(duration: str) -> int:
    return -(-int(parse_duration(duration)) // 60)


def _labels_for(metric_name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    base = metric_name.removesuffix("_total").removesuffix("_bucket")
    m = METRICS_BY_NAME.get(base)
    if m is None:
        raise UnsupportedShape(f"{metric_name} is not a catalogue metric")
    labels = {name: f"{name}-a" for name in m.labels if name != "le"}
    labels.update(extra or {})
    return labels


def _series(name: str, labels: dict[str, str], values: str) -> dict:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}" if inner else name, "values": values}


def _in_scope(series: list[dict], labels: dict[str, str]) -> list[dict]:
    """The input series with the scope labels (``cluster="sick"``) added, as service discovery would."""
    out = []
    for item in series:
        name, _, inner = item["series"].partition("{")
        have = _selector(inner)
        merged = {**labels, **have}
        body = ", ".join(f'{k}="{v}"' for k, v in sorted(merged.items()))
        out.append({**item, "series": f"{name}{{{body}}}" if body else name})
    return out


def _scope_values(th: Thresholds, name: str) -> dict[str, str]:
    return {label: name for label in th.scope_labels}


def _counter(per_min: float, n: int) -> str:
    return f"0+{per_min:g}x{n}"


def _selector(text: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def _histogram(metric: str, sel: dict[str, str], q: float, rated: bool, want: Callable[[float], bool],
               hint: float, n: int) -> Synth:
    base = metric.removesuffix("_bucket")
    bounds = METRICS_BY_NAME[base].buckets
    if not bounds:
        raise UnsupportedShape(f"{base} has no buckets")
    candidates = []
    for i, hi in enumerate(bounds):
        lo = bounds[i - 1] if i else 0.0
        value = lo + (hi - lo) * q
        if want(value):
            candidates.append((abs(value - hint), i, value))
    if not candidates:
        raise UnsupportedShape(f"no bucket of {base} gives a quantile satisfying the case")
    _, k, value = min(candidates)
    series = []
    for i, le in enumerate([*bounds, float("inf")]):
        labels = _labels_for(metric, sel) | {"le": "+Inf" if le == float("inf") else f"{le:g}"}
        filled = i >= k
        values = (_counter(BUCKET_STEP if filled else 0, n) if rated
                  else f"{BUCKET_STEP if filled else 0}x{n}")
        series.append(_series(metric, labels, values))
    return Synth(series, value)


_QUANTILE_BY = re.compile(r"histogram_quantile\(([\d.]+), sum by \(le, ([\w, ]+)\) \(rate\((\w+)_bucket\[(\w+)\]( offset \w+)?\)\)\)")


def _baseline_ratio(num: str, den: str, want: Callable[[float], bool], window_min: int, for_min: int,
                    n: int) -> Synth:
    """Window quantile ÷ baseline quantile (the baseline ends one window ago), by some labels.

    Observations land in one low bucket until minute S and, for a ratio other than 1, in one high
    bucket after it. Just after S + window the window holds only the high ones and the baseline
    only the low ones, so the ratio is exact (rate's range edges and extrapolation do not move it);
    it has held since S + 2, so a `for` shorter than the window has elapsed.
    """
    # A healthy-window baseline falls back on the plain one: before the fault every window is
    # healthy, so both read the low observations (and once the fault breaches, the healthy one
    # keeps reading them).
    a, b = _QUANTILE_BY.fullmatch(num), _QUANTILE_BY.fullmatch(den.rsplit(" or ", 1)[-1])
    if a is None or b is None or a[3] != b[3] or a[1] != b[1] or a[5] or not b[5]:
        raise UnsupportedShape(f"not a window quantile over its baseline quantile: {num} / {den}")
    if for_min >= window_min:
        raise UnsupportedShape(f"`for` ({for_min}m) must be shorter than the window ({window_min}m): the baseline "
                               "takes a fault in one window after it began")
    q, metric = float(a[1]), a[3] + "_bucket"
    bounds = METRICS_BY_NAME[a[3]].buckets or ()
    points = [(lo + (hi - lo) * q, i) for i, (lo, hi) in enumerate(zip((0.0, *bounds), bounds, strict=False))]
    if want(1.0):
        low, high, value = points[len(points) // 2][1], None, 1.0
    else:
        pairs = [(h[0] / lo_[0], lo_[1], h[1]) for lo_ in points for h in points if want(h[0] / lo_[0])]
        if not pairs:
            raise UnsupportedShape(f"no two buckets of {a[3]} give a ratio satisfying the case")
        value, low, high = min(pairs)
    start = 2 + for_min  # minute S: enough baseline history before it
    series = []
    for i, le in enumerate([*bounds, float("inf")]):
        labels = _labels_for(metric) | {"le": "+Inf" if le == float("inf") else f"{le:g}"}
        lows = i >= low
        highs = high is not None and i >= high
        if high is None:
            values = _counter(BUCKET_STEP if lows else 0, n)
        else:  # lows until S, then highs only
            base = BUCKET_STEP * start if lows else 0
            values = f"0+{BUCKET_STEP if lows else 0}x{start} {base}+{BUCKET_STEP if highs else 0}x{n - start - 1}"
        series.append(_series(metric, labels, values))
    # The first high observation shows at S + 2 (the value at S + 1 repeats S's), so at S + window
    # and at S + window + 1 both sides are pure; an alert may read the recording rules of the
    # previous evaluation, so evaluate at the later one.
    return Synth(series, value, eval_min=start + window_min + 1)


_PEER_MEDIAN = re.compile(r"\(([\w:]+) / on \(\) group_left \(\) quantile\(0\.5, \1\)\) and on \(worker\) "
                          r"\(([\w:]+) >= on \(\) group_left \(\) \(threshold\(\w+\) \* quantile\(0\.5, \2\)\)\)")


def _peer_outlier(ratio_rule: str, want: Callable[[float], bool], hint: float, n: int) -> Synth:
    """One worker (``worker-a``, the one the case expects) and three peers at a hit ratio of 0.9, all
    with the same traffic: the median is 0.9 whatever the first one's ratio below it."""
    m = re.fullmatch(r"sum by \(worker\) \(rate\((\w+)\[\w+\]\)\) / sum by \(worker\) \(rate\((\w+)\[\w+\]\)\)",
                     RULES_BY_NAME[ratio_rule].expr)
    if m is None:
        raise UnsupportedShape(f"not a per-worker counter ratio: {ratio_rule}")
    hits, queried = m.groups()
    peer = 0.9
    ratio = hint if want(hint) and hint * peer < peer else next(v for v in (0.25, 0.75, 1.0) if want(v))
    series = []
    for worker, r in (("worker-a", ratio * peer), ("w1", peer), ("w2", peer), ("w3", peer)):
        series += [_series(hits, _labels_for(hits, {"worker": worker}), _counter(600 * r, n)),
                   _series(queried, _labels_for(queried, {"worker": worker}), _counter(600, n))]
    return Synth(series, ratio)


def _over_budget(quantile: str, budgets: dict[str, float], want: Callable[[float], bool], hint: float,
                 n: int) -> Synth:
    """A per-class window quantile over its class's budget: observations of the first class only."""
    m = _QUANTILE_BY.fullmatch(quantile)
    if m is None or m[5] or "prompt_class" not in m[2]:
        raise UnsupportedShape(f"not a window quantile per prompt class: {quantile}")
    label = next(c for _b, c in PROMPT_CLASSES if c in budgets)
    budget = budgets[label]
    got = _histogram(m[3] + "_bucket", {"prompt_class": label}, float(m[1]), True, lambda v: want(v / budget),
                     hint * budget, n)
    return Synth(got.series, got.value / budget)


def synthesise(expr: str, want: Callable[[float], bool], hint: float, n: int, eval_s: int,
               window_min: int = 5, for_min: int = 0, budgets: dict[str, dict[str, float]] | None = None) -> Synth:
    """Input series making ``expr`` evaluate to a value satisfying ``want`` (near ``hint``)."""
    expr = expr.strip()
    budgets = budgets or {}
    if expr in RULES_BY_NAME:
        return synthesise(RULES_BY_NAME[expr].expr, want, hint, n, eval_s, window_min, for_min, budgets)
    if m := re.fullmatch(r"(max|min|avg)\((\S+)\)", expr):
        inner = m.group(2)
        if inner in RULES_BY_NAME:
            return synthesise(inner, want, hint, n, eval_s, window_min, for_min, budgets)
        return Synth([_series(inner, _labels_for(inner), f"{hint:g}x{n}")], hint)
    if m := re.fullmatch(r"(\S+) \* on \(worker\) \((\S+) > bool threshold\(\w+\)\)", expr):
        # the worker's value, kept where the gate series is past its threshold (a share: 1 is past any)
        value = synthesise(m.group(1), want, hint, n, eval_s)
        gate = synthesise(m.group(2), lambda v: v >= 1.0, 1.0, n, eval_s)
        return Synth(value.series + gate.series, value.value)
    if expr == SHARDS_MISSING_BY_SHARD:
        return _shards(want, n)
    if m := re.fullmatch(r"absent\((\w+)\)(?: or vector\(0\))?", expr):
        # absent() is 1 without the series and empty (no alert) with it.
        if want(1.0):
            return Synth([], 1.0)
        return Synth([_series(m.group(1), _labels_for(m.group(1)), f"1x{n}")], 0.0)
    if m := re.fullmatch(r"\((.+)\) >= 0", expr):
        # a quantile kept only where it observed something (catalog._observed): input that observes
        return synthesise(m.group(1), want, hint, n, eval_s, window_min, for_min, budgets)
    if m := re.fullmatch(r"\((.+) >= 0\) or \((.+)\)", expr):
        # the first value, else the second: with no input for the first, the second decides (the
        # first's precedence and its NaN fallback are in tests/alerts/handwritten.test.yaml)
        return synthesise(m.group(2), want, hint, n, eval_s, window_min, for_min)
    if m := _PEER_MEDIAN.fullmatch(expr):
        return _peer_outlier(m[1], want, hint, n)
    if m := BUDGET_REF.fullmatch(expr):
        # the first prompt class, its p99 over its budget
        return _over_budget(RULES_BY_NAME[m[1]].expr, budgets[m[2]], want, hint, n)
    if (m := re.fullmatch(r"([\w:]+) / ([\w:]+)", expr)) and m[1] in RULES_BY_NAME and m[2] in RULES_BY_NAME:
        return _baseline_ratio(RULES_BY_NAME[m[1]].expr, RULES_BY_NAME[m[2]].expr, want, window_min, for_min, n)
    if m := re.fullmatch(r"sum (?:by \(worker\) )?\(rate\((\w+)\[\w+\]\)\) / "
                         r"sum (?:by \(worker\) )?\(rate\((\w+)\[\w+\]\)\)", expr):
        num, den = m.groups()
        den_rate = 600.0
        return Synth([_series(num, _labels_for(num), _counter(den_rate * hint, n)),
                      _series(den, _labels_for(den), _counter(den_rate, n))], hint)
    if m := re.fullmatch(r"sum \(rate\((\w+)\{(\w+)=\"([^\"]*)\"\}\[\w+\]\)\) / sum \(rate\((\w+)\[\w+\]\)\)", expr):
        # a share of one counter family: its selected part against all of it (the rest another value)
        name, label, value, den = m.groups()
        if den != name:
            raise UnsupportedShape(f"a selected share of another counter: {expr}")
        den_rate = 600.0
        return Synth([_series(name, _labels_for(name, {label: value}), _counter(den_rate * hint, n)),
                      _series(name, _labels_for(name, {label: f"not-{value}"}), _counter(den_rate * (1 - hint), n))],
                     hint)
    if m := re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(le\) \(rate\((\w+)(\{[^}]*\})?\[\w+\]\)\)\)", expr):
        return _histogram(m.group(2), _selector(m.group(3) or ""), float(m.group(1)), True, want, hint, n)
    if m := re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(le\) \((\w+)\)\)", expr):
        return _histogram(m.group(2), {}, float(m.group(1)), False, want, hint, n)
    if (m := _QUANTILE_BY.fullmatch(expr)) and not m[5]:
        # per label set (a worker's): one label set, its quantile as above
        return _histogram(f"{m[3]}_bucket", {}, float(m[1]), True, want, hint, n)
    if m := re.fullmatch(r"sum\(rate\((\w+)\[\w+\]\)\) \* 60", expr):
        return Synth([_series(m.group(1), _labels_for(m.group(1)), _counter(hint, n))], hint)
    if m := re.fullmatch(r"sum\(rate\((\w+)\[\w+\]\)\)", expr):
        return Synth([_series(m.group(1), _labels_for(m.group(1)), _counter(hint * 60, n))], hint)
    if m := re.fullmatch(r"sum\(increase\((\w+)\[\w+\]\)\)", expr):
        # increase over the window of a counter moving hint / window_min per minute: hint
        return Synth([_series(m.group(1), _labels_for(m.group(1)), _counter(hint / window_min, n))], hint)
    if m := re.fullmatch(r"max\(time\(\) - (\w+)\)", expr):
        # Last batch at t=0 (value grows with time) or a batch every interval (value stays 0). A long
        # threshold is crossed late: evaluate once `for` has elapsed after the crossing.
        if want(float(eval_s)):
            crossed = next(i for i in range(n) if want(i * 60.0))
            at_min = max(eval_s // 60, crossed + for_min + 1)
            if at_min >= n:
                raise UnsupportedShape(f"the threshold is crossed too late for the case's {n} minutes: {expr}")
            return Synth([_series(m.group(1), _labels_for(m.group(1)), f"0x{n}")], float(at_min * 60),
                         eval_min=at_min if at_min * 60 != eval_s else None)
        return Synth([_series(m.group(1), _labels_for(m.group(1)), f"0+{INTERVAL_S}x{n}")], 0.0)
    if m := re.fullmatch(r"sum\(\(time\(\) - (\w+)\) > bool threshold\(\w+\)\) / count\((\w+)\)", expr):
        # four workers, k of them silent since the start (their age grows), the others fresh
        k = next((k for k in (round(hint * 4), 0, 4, 2, 1, 3) if want(k / 4)), None)
        if k is None:
            raise UnsupportedShape(f"no share of four workers satisfies the case: {expr}")
        return Synth([_series(m[1], _labels_for(m[1], {"worker": f"w{i}"}), f"0x{n}" if i < k else f"0+{INTERVAL_S}x{n}")
                      for i in range(4)], k / 4)
    if m := re.fullmatch(r"sum by \((\w+)\) \((\w+)\) / on \(\w+\) max by \(\w+\) \((\w+)\)", expr):
        _, num, den = m.groups()
        return Synth([_series(num, _labels_for(num), f"{1000 * hint:g}x{n}"),
                      _series(den, _labels_for(den), f"1000x{n}")], hint)
    raise UnsupportedShape(f"no input synthesiser for the expression shape: {expr}")


SHARD_COUNT = 3
DEAD_SHARD = "1"


def _shards(want: Callable[[float], bool], n: int) -> Synth:
    """Three family shards that all report (0 missing), or shard 1 scraped for two minutes and then
    gone (a stale marker, as Prometheus writes at a failed scrape): 1 missing, labelled shard 1."""
    name = "prefixscope_exporter_shards"
    dies = want(1.0)
    series = [_series(name, {"shard": str(i)}, f"{SHARD_COUNT}x2 stale" if dies and str(i) == DEAD_SHARD
                      else f"{SHARD_COUNT}x{n}") for i in range(SHARD_COUNT)]
    if dies:
        return Synth(series, 1.0, labels={"shard": DEAD_SHARD})
    if not want(0.0):
        raise UnsupportedShape("missing shards are 0 or 1 per shard")
    return Synth(series, 0.0)


def _hints(check: Check, threshold: float, firing: bool) -> tuple[Callable[[float], bool], float]:
    if check.op == "<":
        if firing:
            # A 0/1 signal such as `up` fails at 0, not at half.
            return (lambda v: v < threshold), threshold / 2 if threshold != 1 else 0.0
        return (lambda v: v >= threshold), (threshold + 1) / 2 if threshold < 1 else threshold
    if firing:
        return (lambda v: v > threshold), threshold * 2 if threshold else 5.0
    return (lambda v: v <= threshold), threshold / 2


def _expected(rules: list[dict], value: float, labels: dict[str, str] | None = None) -> list[dict]:
    out = []
    for rule in rules:
        annotations = dict(rule["annotations"])
        annotations["description"] = render_value_template(annotations["description"], value)
        out.append({"exp_labels": {**rule["labels"], **(labels or {})}, "exp_annotations": annotations})
    return out


def case(check: Check, th: Thresholds, firing: bool, dashboard_url: str) -> dict:
    """A firing case runs two clusters (scope values) in one Prometheus: the sick one must alert with
    its scope labels (and, for a per-worker check, its worker), the healthy one must not."""
    if not firing:
        return _case(check, th, False, dashboard_url)
    sick = _case(check, th, True, dashboard_url)
    if not sick["input_series"] or not th.scope_labels:
        return sick  # absent(): no series to give a scope (scoped absence: tests/alerts)
    healthy = _case(check, th, False, dashboard_url)
    sick["name"] += " for the sick cluster only"
    sick["input_series"] = (_in_scope(sick["input_series"], _scope_values(th, "sick"))
                            + _in_scope(healthy["input_series"], _scope_values(th, "healthy")))
    for alert in sick["alert_rule_test"][0]["exp_alerts"]:
        alert["exp_labels"] |= _scope_values(th, "sick")
    return sick


def _case(check: Check, th: Thresholds, firing: bool, dashboard_url: str) -> dict:
    entry = th.checks[check.threshold]
    for_min, window_min = _minutes(entry.for_), _minutes(th.window)
    eval_min = for_min + TAIL_MINUTES
    n = eval_min + window_min + 5
    eval_s = eval_min * 60
    try:
        if check.baseline:
            # A low baseline makes the firing case easy, a high one the silent case.
            base = synthesise(check.baseline, lambda v: v > 0, 0.0 if firing else 1e9, n, eval_s, window_min, for_min)
            limit = entry.value * base.value
            want = (lambda v: v > limit) if firing else (lambda v: v <= limit)
            main = synthesise(check.value, want, limit * (2 if firing else 0.5), n, eval_s, window_min, for_min)
            series = base.series + main.series
        else:
            want, hint = _hints(check, entry.value, firing)
            main = synthesise(check.value, want, hint, n, eval_s, window_min, for_min, th.budgets())
            series = main.series
    except UnsupportedShape as exc:
        raise UnsupportedShape(f"{check.alert}: {exc}") from exc
    eval_min = main.eval_min or eval_min
    rules = alert_rules(check, th, dashboard_url)
    return {
        "name": f"{check.alert} {'fires' if firing else 'stays silent'}",
        "interval": f"{INTERVAL_S}s",
        "input_series": series,
        "alert_rule_test": [{"eval_time": f"{eval_min}m", "alertname": check.alert,
                             "exp_alerts": _expected(rules, main.value,
                                                     {p: f"{p}-a" for p in check.per} | main.labels)
                             if firing else []}],
    }


BURN_HOURS = 8  # the slow burns run this long: past the 6h window of the ticket's short side
SLOW_BURN = 1.2  # a burn a little faster than the budget's pace: a ticket, never a page
FAST_BURN = 5.0  # a burn five times the budget's pace (a 30-day budget gone in 6 days): a page


def slo_cases(check: Check, th: Thresholds, dashboard_url: str) -> list[dict]:
    """An SLO's burn-rate tiers: each tier fires (with the tiers below it) at an error ratio just
    above its limit, and nothing fires just below the lowest limit; then hours of input: an 8-hour
    burn at 1.2 × the budget's pace opens a ticket and pages nobody, and a 5 × burn (where the
    budget allows one; else a burn between the 6h page's factor and the budget's ceiling) fires
    every tier whose factor is below it, in the sick cluster only.

    Good and total events move at constant rates, so every window reads the same error ratio.
    """
    assert check.slo is not None
    entry = th.checks[check.threshold]
    eval_min = _minutes(entry.for_) + TAIL_MINUTES
    rules = alert_rules(check, th, dashboard_url)
    tiers = sorted(zip((entry.burn_limit(p.pair) for p in BURN_WINDOWS), BURN_WINDOWS, rules, strict=True),
                   key=lambda x: x[0])
    out = []
    levels = [(tiers[0][0] * 0.9, "stays silent")]
    for i, (limit, pair, _rule) in enumerate(tiers):
        upper = tiers[i + 1][0] if i + 1 < len(tiers) else 1.0
        levels.append(((limit + upper) / 2, f"fires its {pair.pair} tier"))
    for error, what in levels:
        out.append(_slo_case(check, th, f"{check.alert} {what} at an error ratio of {round(error, 4):g}",
                             round(error, 4), eval_min, tiers))
    budget = 1.0 - entry.value
    burns = [(SLOW_BURN, f"an 8-hour burn at {SLOW_BURN:g} × opens a ticket and pages nobody")]
    if FAST_BURN * budget < 1.0:
        burns.append((FAST_BURN, f"an 8-hour burn at {FAST_BURN:g} × fires every tier below {FAST_BURN:g} ×"))
    else:  # no such burn: the error ratio would pass 1; its fastest burns between the 6h page and the ceiling
        assert entry.burn_rates is not None
        fast = round((entry.burn_rates["page_6h"] + 1.0 / budget) / 2, 2)
        burns.append((fast, f"an 8-hour burn at {fast:g} × (its budget's ceiling is {1.0 / budget:.3g} ×, "
                            f"under {FAST_BURN:g}) fires every tier below {fast:g} ×"))
    for factor, what in burns:
        out.append(_slo_case(check, th, f"{check.alert}: {what}", round(factor * budget, 6), BURN_HOURS * 60,
                             tiers, healthy=round(0.5 * budget, 6)))
    return out


def _slo_case(check: Check, th: Thresholds, name: str, error: float, eval_min: int, tiers: list,
              healthy: float | None = None) -> dict:
    """Constant error ratio ``error`` from the start; with ``healthy``, a second cluster burning at
    that ratio must stay silent while the first alerts with its scope labels."""
    assert check.slo is not None
    n, total = eval_min + 5, 1000.0

    def inputs(err: float) -> list[dict]:
        return [_series(check.slo.good, _labels_for(check.slo.good), _counter(total * (1 - err), n)),
                _series(check.slo.total, _labels_for(check.slo.total), _counter(total, n))]

    firing = [rule for limit, _pair, rule in tiers if error > limit]
    series, labels = inputs(error), {}
    if healthy is not None and th.scope_labels:
        labels = _scope_values(th, "sick")
        series = _in_scope(series, labels) + _in_scope(inputs(healthy), _scope_values(th, "healthy"))
    return {
        "name": name,
        "interval": f"{INTERVAL_S}s",
        "input_series": series,
        "alert_rule_test": [{"eval_time": f"{eval_min}m", "alertname": check.alert,
                             "exp_alerts": _expected(firing, error, labels)}],
    }


def test_file(th: Thresholds, rule_file_name: str, dashboard_urls: dict[str, str]) -> dict:
    tests = []
    rule = watchdog_rule(th)
    for check in CHECKS:
        if check.slo is not None:
            tests += slo_cases(check, th, dashboard_urls[check.alert])
            continue
        tests.append(case(check, th, True, dashboard_urls[check.alert]))
        tests.append(case(check, th, False, dashboard_urls[check.alert]))
    tests.append({"name": "PrefixWatchdog fires with no input at all", "interval": f"{INTERVAL_S}s",
                  "input_series": [],
                  "alert_rule_test": [{"eval_time": "1m", "alertname": WATCHDOG,
                                       "exp_alerts": [{"exp_labels": rule["labels"],
                                                       "exp_annotations": rule["annotations"]}]}]})
    return {"rule_files": [rule_file_name], "evaluation_interval": f"{INTERVAL_S}s", "tests": tests}
