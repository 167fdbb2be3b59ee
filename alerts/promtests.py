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
from dataclasses import dataclass

from alerts.rules import alert_rule
from prefixscope.catalog import CHECKS, METRICS_BY_NAME, RULES_BY_NAME, Check
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


def synthesise(expr: str, want: Callable[[float], bool], hint: float, n: int, eval_s: int) -> Synth:
    """Input series making ``expr`` evaluate to a value satisfying ``want`` (near ``hint``)."""
    expr = expr.strip()
    if expr in RULES_BY_NAME:
        return synthesise(RULES_BY_NAME[expr].expr, want, hint, n, eval_s)
    if m := re.fullmatch(r"(max|min|avg)\((\S+)\)", expr):
        inner = m.group(2)
        if inner in RULES_BY_NAME:
            return synthesise(inner, want, hint, n, eval_s)
        return Synth([_series(inner, _labels_for(inner), f"{hint:g}x{n}")], hint)
    if m := re.fullmatch(r"(\S+) \* on \(worker\) \((\S+) > bool threshold\(\w+\)\)", expr):
        # the worker's value, kept where the gate series is past its threshold (a share: 1 is past any)
        value = synthesise(m.group(1), want, hint, n, eval_s)
        gate = synthesise(m.group(2), lambda v: v >= 1.0, 1.0, n, eval_s)
        return Synth(value.series + gate.series, value.value)
    if m := re.fullmatch(r"sum (?:by \(worker\) )?\(rate\((\w+)\[5m\]\)\) / "
                         r"sum (?:by \(worker\) )?\(rate\((\w+)\[5m\]\)\)", expr):
        num, den = m.groups()
        den_rate = 600.0
        return Synth([_series(num, _labels_for(num), _counter(den_rate * hint, n)),
                      _series(den, _labels_for(den), _counter(den_rate, n))], hint)
    if m := re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(le\) \(rate\((\w+)(\{[^}]*\})?\[\w+\]\)\)\)", expr):
        return _histogram(m.group(2), _selector(m.group(3) or ""), float(m.group(1)), True, want, hint, n)
    if m := re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(le\) \((\w+)\)\)", expr):
        return _histogram(m.group(2), {}, float(m.group(1)), False, want, hint, n)
    if m := re.fullmatch(r"sum\(rate\((\w+)\[5m\]\)\) \* 60", expr):
        return Synth([_series(m.group(1), _labels_for(m.group(1)), _counter(hint, n))], hint)
    if m := re.fullmatch(r"sum\(rate\((\w+)\[5m\]\)\)", expr):
        return Synth([_series(m.group(1), _labels_for(m.group(1)), _counter(hint * 60, n))], hint)
    if m := re.fullmatch(r"sum\(increase\((\w+)\[5m\]\)\)", expr):
        return Synth([_series(m.group(1), _labels_for(m.group(1)), _counter(hint / 5, n))], hint)
    if m := re.fullmatch(r"max\(time\(\) - (\w+)\)", expr):
        # Last batch at t=0 (value grows with time) or a batch every interval (value stays 0).
        if want(float(eval_s)):
            return Synth([_series(m.group(1), _labels_for(m.group(1)), f"0x{n}")], float(eval_s))
        return Synth([_series(m.group(1), _labels_for(m.group(1)), f"0+{INTERVAL_S}x{n}")], 0.0)
    if m := re.fullmatch(r"(\w+) / on \((\w+)\) (\w+)", expr):
        num, _, den = m.groups()
        return Synth([_series(num, _labels_for(num), f"{1000 * hint:g}x{n}"),
                      _series(den, _labels_for(den), f"1000x{n}")], hint)
    raise UnsupportedShape(f"no input synthesiser for the expression shape: {expr}")


def _hints(check: Check, threshold: float, firing: bool) -> tuple[Callable[[float], bool], float]:
    if check.op == "<":
        if firing:
            # A 0/1 signal such as `up` fails at 0, not at half.
            return (lambda v: v < threshold), threshold / 2 if threshold != 1 else 0.0
        return (lambda v: v >= threshold), (threshold + 1) / 2 if threshold < 1 else threshold
    if firing:
        return (lambda v: v > threshold), threshold * 2 if threshold else 5.0
    return (lambda v: v <= threshold), threshold / 2


def case(check: Check, th: Thresholds, firing: bool, dashboard_url: str) -> dict:
    entry = th.checks[check.threshold]
    eval_min = _minutes(entry.for_) + TAIL_MINUTES
    n = eval_min + 5
    eval_s = eval_min * 60
    try:
        if check.baseline:
            # A low baseline makes the firing case easy, a high one the silent case.
            base = synthesise(check.baseline, lambda v: v > 0, 0.0 if firing else 1e9, n, eval_s)
            limit = entry.value * base.value
            want = (lambda v: v > limit) if firing else (lambda v: v <= limit)
            main = synthesise(check.value, want, limit * (2 if firing else 0.5), n, eval_s)
            series = base.series + main.series
        else:
            want, hint = _hints(check, entry.value, firing)
            main = synthesise(check.value, want, hint, n, eval_s)
            series = main.series
    except UnsupportedShape as exc:
        raise UnsupportedShape(f"{check.alert}: {exc}") from exc
    rule = alert_rule(check, th, dashboard_url)
    expected = []
    if firing:
        annotations = dict(rule["annotations"])
        annotations["description"] = render_value_template(annotations["description"], main.value)
        expected = [{"exp_labels": rule["labels"], "exp_annotations": annotations}]
    return {
        "name": f"{check.alert} {'fires' if firing else 'stays silent'}",
        "interval": f"{INTERVAL_S}s",
        "input_series": series,
        "alert_rule_test": [{"eval_time": f"{eval_min}m", "alertname": check.alert, "exp_alerts": expected}],
    }


def test_file(th: Thresholds, rule_file_name: str, dashboard_urls: dict[str, str]) -> dict:
    tests = []
    for check in CHECKS:
        tests.append(case(check, th, True, dashboard_urls[check.alert]))
        tests.append(case(check, th, False, dashboard_urls[check.alert]))
    return {"rule_files": [rule_file_name], "evaluation_interval": f"{INTERVAL_S}s", "tests": tests}
