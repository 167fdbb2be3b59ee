"""The recording rules aggregate across exporter shards: every ratio sums (or maxes) each side over
all series before dividing, every quantile sums its buckets, so N shards' series give one answer."""

from __future__ import annotations

import itertools
import re

from prefixscope.catalog import RECORDING_RULES, RULES_BY_NAME


def _sides(expr: str, op: str = "/") -> list[str]:
    depth, cut = 0, []
    for i, ch in enumerate(expr):
        depth += ch == "("
        depth -= ch == ")"
        if ch == op and depth == 0:
            cut.append(i)
    bounds = [0, *cut, len(expr)]
    return [expr[a:b].strip(f" {op}") for a, b in itertools.pairwise(bounds)]


def _aggregated(side: str) -> bool:
    """A side that pools every shard's series: a sum, max or count, a difference of such in parentheses,
    or another recording rule (checked on its own)."""
    side = re.sub(r"^on \(\w+\) ", "", side).strip()
    if side in RULES_BY_NAME:
        return True
    if side.startswith("(") and side.endswith(")") and len(_sides(side[1:-1], "-")) > 1:
        return all(_aggregated(p) for p in _sides(side[1:-1], "-"))
    return bool(re.match(r"(sum|max|count)( by \([\w, ]+\))? ?\(", side))


def test_every_ratio_aggregates_both_sides_before_dividing() -> None:
    ratios = [r for r in RECORDING_RULES if len(_sides(r.expr)) > 1]
    assert ratios
    unsafe = set()
    for rule in ratios:
        if not all(_aggregated(side) for side in _sides(rule.expr)):
            unsafe.add(rule.record)
    assert not unsafe


def test_every_quantile_sums_its_buckets() -> None:
    for rule in RECORDING_RULES:
        if rule.expr.startswith("histogram_quantile"):
            assert "sum by (le" in rule.expr, rule.record
