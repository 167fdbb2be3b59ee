"""The console reads a signal as available when any exporter shard reports it."""

from __future__ import annotations

from console.data import signals_available
from console.prom import Sample


def sample(instance: str, signal: str, value: float) -> Sample:
    return Sample({"instance": instance, "signal": signal}, value)


def test_a_signal_one_shard_reports_is_available_in_any_order() -> None:
    # shard 0 scrapes the routers and its home workers; shard 1 is home to no worker
    rows = [sample("shard0", "worker_metrics", 1.0), sample("shard0", "router_metrics", 1.0),
            sample("shard1", "worker_metrics", 0.0), sample("shard1", "router_metrics", 0.0),
            sample("shard1", "spec_decode", 0.0)]
    for order in (rows, rows[::-1]):
        assert signals_available(order) == {"worker_metrics": True, "router_metrics": True, "spec_decode": False}


def test_no_data_is_not_a_signal() -> None:
    assert signals_available([sample("shard0", "records", None)]) == {"records": False}  # type: ignore[arg-type]


def test_a_shards_answer_says_so_and_the_console_warns() -> None:
    from console.chain import chain_from_exporter, shard_note

    groups = {"steps": [], "reuse": {}, "shard": {"index": 1, "count": 3}}
    chain = chain_from_exporter(groups)
    assert chain.shard == (1, 3)
    note = shard_note(chain.shard)
    assert note is not None and "shard 2 of 3" in note and "--prometheus-url" in note
    for whole in (None, {"index": 0, "count": 1}, {"index": 3, "count": 3}, {"index": "1", "count": 3}):
        assert chain_from_exporter({**groups, "shard": whole}).shard is None
    assert shard_note(None) is None


def test_a_missing_shard_makes_the_cluster_answer_partial() -> None:
    """From Prometheus: PrefixExporterShardDown's value is 1 per missing shard (labelled), or the
    scope's shortfall when none can be named; the headline says the answer is partial, and which."""
    from dataclasses import replace

    from console.chain import Reuse, chain_from_prometheus
    from console.limits import limits_from_file
    from prefixscope.thresholds import load_thresholds

    limits = limits_from_file(load_thresholds(), "thresholds.yaml")

    def chain(missing: float | None, alerts: list[dict] | None = None):
        return chain_from_prometheus({"exporter_shards": missing}, {}, {}, alerts or [], limits,
                                     Reuse(None, None, None))

    assert chain(0.0).partial is None and chain(None).partial is None
    firing = [{"labels": {"alertname": "PrefixExporterShardDown", "shard": "1"}, "state": "firing"}]
    named = replace(chain(1.0, firing), missing_shards=("1",))
    assert named.shards_missing == 1
    assert named.partial is not None and named.partial.startswith("**PARTIAL** · 1 of the exporter's family shards is")
    assert 'shard="1"' in named.partial
    assert named.headline.state == "firing" and named.headline.step.number == 0  # a telemetry cause
    unnamed = chain(2.0)
    assert unnamed.partial is not None and "2 of the exporter's family shards are not scraped:" in unnamed.partial
    assert unnamed.checks()["exporter_shards"].pending  # past its threshold, not fired yet
