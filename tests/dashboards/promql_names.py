"""Metric names used in PromQL text, and whether the catalogue knows them."""

from __future__ import annotations

import re

from prefixscope.catalog import METRICS, NAMESPACE, RULES_BY_NAME

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES = re.compile(r"\{[^}]*\}")
_NAME = re.compile(rf"\b(?:[a-z_]+:)?{NAMESPACE}_[A-Za-z0-9_]+(?::[A-Za-z0-9_]+)?")


def known_series() -> set[str]:
    names = set(RULES_BY_NAME)
    for m in METRICS:
        names.add(m.sample_name)
        if m.type in ("histogram", "gaugehistogram"):
            names |= {f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"}
    return names


def metric_names(promql: str) -> set[str]:
    """Series names in a PromQL expression (label matchers and strings removed first)."""
    text = _BRACES.sub("", _STRING.sub('""', promql))
    return set(_NAME.findall(text))


def unknown(promql: str) -> set[str]:
    return metric_names(promql) - known_series()
