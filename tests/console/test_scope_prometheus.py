"""The console against one Prometheus watching two clusters: every query reads the chosen one.

Cluster ``a`` is the backfilled incident (hit rate 41 %, PrefixHitRateLow fires); cluster ``b`` is
the same fleet hitting 90 %. Both carry the ``cluster`` label service discovery would add.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import yaml

from console import promql
from console.links import GENERATED_RULES
from console.prom import PrometheusClient
from prefixscope.catalog import SIGNALS
from tests import servers
from tests.console import backfill
from tests.support import require_file

pytestmark = pytest.mark.slow
HIT = "prefixscope_prefix_cache_hit_tokens_total"
LINE = re.compile(r"^(\w+)\{(.*)\} (\S+) (\S+)$")


def two_clusters(text: str) -> str:
    """The backfill as cluster ``a``, and a copy as cluster ``b`` whose engines hit 90 of 100 tokens."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        name, labels, value, t = m.groups()
        sep = "," if labels else ""
        out.append(f'{name}{{cluster="a"{sep}{labels}}} {value} {t}')
        value_b = f"{float(value) * 90 / 41:.6f}" if name == HIT else value
        out.append(f'{name}{{cluster="b"{sep}{labels}}} {value_b} {t}')
    return "\n".join(out) + "\n# EOF\n"


@pytest.fixture(scope="module")
def two_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_file(GENERATED_RULES, "the generated rules (run prefixscope generate)")
    rules = servers.alerts_at_once(yaml.safe_load(GENERATED_RULES.read_text(encoding="utf-8")))
    history = two_clusters(backfill.openmetrics(list(SIGNALS), time.time() - 2))
    with servers.prometheus(tmp_path_factory.mktemp("prometheus"), rules, history, {"PrefixHitRateLow"}) as url:
        yield url


def _hit_rate(client: PrometheusClient) -> list[float | None]:
    return [s.value for s in client.query(promql.check_value("prefix_hit_rate_total"))]


def test_each_cluster_reads_its_own_numbers_and_alerts(two_cluster_url: str) -> None:
    sick = PrometheusClient(two_cluster_url, scope=promql.Scope("cluster", "a"))
    healthy = PrometheusClient(two_cluster_url, scope=promql.Scope("cluster", "b"))
    assert _hit_rate(sick) == [pytest.approx(0.41)] and _hit_rate(healthy) == [pytest.approx(0.9)]
    # an aggregation the console writes keeps the clusters apart too
    assert {s.labels["worker"]: s.value for s in healthy.query(promql.by_label(
        "worker:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m", "worker"))} == {
        "w0": pytest.approx(0.9)}
    assert "PrefixHitRateLow" in {a["labels"]["alertname"] for a in sick.alerts()}
    assert "PrefixHitRateLow" not in {a["labels"]["alertname"] for a in healthy.alerts()}
    assert {a["labels"]["cluster"] for a in sick.alerts()} == {"a"}
    # unscoped, the rules' two clusters both answer: a chain read off the first would mix them
    assert sorted(_hit_rate(PrometheusClient(two_cluster_url))) == [pytest.approx(0.41), pytest.approx(0.9)]


def test_without_a_chosen_cluster_the_console_shows_the_first_and_says_there_are_two(two_cluster_url: str) -> None:
    client = PrometheusClient(two_cluster_url, scope=promql.Scope("cluster", None))
    assert _hit_rate(client) == [pytest.approx(0.41)]
    assert client.scope == promql.Scope("cluster", "a")
    assert client.scope_note is not None and "a, b" in client.scope_note and "--cluster" in client.scope_note
