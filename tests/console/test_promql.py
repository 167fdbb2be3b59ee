"""PromQL templates: catalogue bases, whitelisted labels, and label values that cannot escape."""

from __future__ import annotations

import pytest

from console import promql
from console.promql import UnsafeQuery, escape_label_value, selector

HOSTILE = 'x"} or vector(1) #'


def test_escape_backslash_quote_and_newline() -> None:
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'


def test_hostile_value_stays_inside_its_quotes() -> None:
    q = selector("prefixscope_up", {"target": HOSTILE})
    assert q == 'prefixscope_up{target="x\\"} or vector(1) #"}'


@pytest.mark.parametrize("value", [HOSTILE, 'w0"}', "\\", '\\"} or up', "a\nb", '"', "ends with \\"])
def test_every_hostile_value_is_one_string_literal(value: str) -> None:
    q = selector("prefixscope_worker_resident_blocks", {"worker": value})
    inner = q[len('prefixscope_worker_resident_blocks{worker="'):-2]
    # Unescaping the literal gives the value back, and no unescaped quote ends it early.
    assert inner.encode().decode("unicode_escape") == value
    assert q.endswith('"}') and "\n" not in q


def test_labels_are_sorted_for_stable_queries() -> None:
    assert selector("prefixscope_up", {"target": "a", "kind": "worker"}) == \
        'prefixscope_up{kind="worker", target="a"}'


@pytest.mark.parametrize("base", ["up", "prefixscope_up or vector(1)", "vector(1)", "prefixscope_nope"])
def test_only_catalogue_names_are_query_bases(base: str) -> None:
    with pytest.raises(UnsafeQuery):
        selector(base)


def test_catalogue_names_and_rules_are_query_bases() -> None:
    assert selector("prefixscope_session_migrations_total") == "prefixscope_session_migrations_total"
    assert selector("prefixscope_cold_prefill_seconds_bucket") == "prefixscope_cold_prefill_seconds_bucket"
    rule = "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m"
    assert selector(rule) == rule


@pytest.mark.parametrize("label", ["__name__", "instance", 'worker="x"', "job"])
def test_only_catalogue_label_names(label: str) -> None:
    with pytest.raises(UnsafeQuery):
        selector("prefixscope_up", {label: "x"})
    with pytest.raises(UnsafeQuery):
        promql.by_label("prefixscope_up", label)


def test_rate_per_minute_by() -> None:
    assert promql.rate_per_minute_by("prefixscope_session_migrations_total", "kind") == \
        "sum by (kind) (rate(prefixscope_session_migrations_total[5m])) * 60"
    with pytest.raises(UnsafeQuery):
        promql.rate_per_minute_by("prefixscope_session_migrations_total", "kind", window="5m]) or vector(1) #")


def test_check_queries_come_from_the_catalogue() -> None:
    assert promql.check_value("prefix_hit_rate_total") == \
        "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m"
    assert promql.check_value("cold_prefill_time_p99") == \
        "max(prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline)"
    assert promql.check_baseline("cold_prefill_time_p99") is None  # the ratio rule divides by the baseline
    with pytest.raises(UnsafeQuery):
        promql.check_value("vector(1)")


def test_a_scope_narrows_every_series_and_keeps_every_aggregation_apart() -> None:
    scope = promql.Scope("cluster", 'a"} or vector(1) #')
    got = promql.scoped("max(worker:prefixscope_kv_thrash_of_full_cache:ratio_rate5m)", scope)
    assert got == ('max by (cluster) (worker:prefixscope_kv_thrash_of_full_cache:ratio_rate5m'
                   '{cluster="a\\"} or vector(1) #"})')
    # no value (a Prometheus without the label): aggregations keep it, nothing is selected
    assert promql.scoped("sum(rate(prefixscope_requests_total[5m]))", promql.Scope()) == (
        "sum by (cluster) (rate(prefixscope_requests_total[5m]))")
    assert promql.scoped("sum(rate(prefixscope_requests_total[5m]))", None) == "sum(rate(prefixscope_requests_total[5m]))"
    with pytest.raises(promql.UnsafeQuery):
        promql.Scope("cluster) or vector(1", "a")
