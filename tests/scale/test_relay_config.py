"""The relay's config, subjects and CLI entries."""

from __future__ import annotations

import pytest

from exporter.codecs.kv_stream import subject_for, worker_from_subject
from exporter.config import ConfigError
from exporter.relay import parse_relay_config
from prefixscope.cli import SUBCOMMANDS
from tests.contracts.test_layers import loaded_packages


def test_a_full_config_and_its_defaults() -> None:
    cfg = parse_relay_config({"nats": {"url": "nats://n:4222"}, "retention": {"max_age": "2h", "max_bytes": 1000},
                              "workers": [{"name": "w0", "kv_events": "tcp://h:5557", "replay": "tcp://h:5558"}]})
    assert cfg.max_age_s == 7200 and cfg.max_bytes == 1000 and cfg.stream == "PREFIXSCOPE_KV"
    assert cfg.workers[0].replay == "tcp://h:5558"


def test_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse_relay_config({"nats": {"url": "http://x", "subject_prefix": "a.>"}, "retention": {"max_bytes": -1},
                            "colour": 1, "workers": [{"name": "w"}]}, "relay.yaml")
    text = str(err.value)
    for part in ("nats.url", "nats.subject_prefix", "retention.max_bytes", "colour: unknown field", "workers[0]"):
        assert f"relay.yaml: {part}" in text


def test_problems_read_as_file_path_problem_from_the_schema(tmp_path) -> None:
    """The relay's config is checked against prefixscope/schemas/relay-config.v1.json, worded as
    every other config file's problems are; the code adds what spans fields (a worker to relay)."""
    with pytest.raises(ConfigError) as err:
        parse_relay_config({"nats": {"url": "http://x", "stream": "a b"}, "retention": {"max_age": "5x"},
                            "max_pending": 0, "workers": [{"name": "w", "kv_events": "nats://n:4222"}]}, "relay.yaml")
    assert err.value.problems == [
        'relay.yaml: nats.url: expected a NATS URL (nats://HOST:PORT or tls://HOST:PORT), got "http://x"',
        'relay.yaml: nats.stream: expected a name without spaces, * or >, got "a b"',
        'relay.yaml: retention.max_age: expected a number of seconds ≥ 0 or a duration like 500ms, 5m or 1h30m, '
        'got "5x"',
        'relay.yaml: workers[0].kv_events: expected a ZMQ endpoint (tcp://, ipc:// or inproc://), got "nats://n:4222"',
        "relay.yaml: max_pending: expected a positive integer, got 0",
    ]
    with pytest.raises(ConfigError) as err:
        parse_relay_config({"fleet_manifest": str(tmp_path / "absent.json")}, "relay.yaml")
    assert err.value.problems[-1] == "relay.yaml: workers: no worker with kv_events to relay"
    assert err.value.problems[0].startswith('relay.yaml: fleet_manifest: cannot read "')
    # an exporter's worker entry may be given as it is
    cfg = parse_relay_config({"workers": [{"name": "w0", "kv_events": "tcp://h:1", "metrics_url": "http://h:2/metrics",
                                           "topic": None}]})
    assert cfg.workers[0].topic == "" and cfg.nats_url == "nats://127.0.0.1:4222"


def test_subjects_round_trip_any_worker_name() -> None:
    for name in ("w0", "10.0.0.3:8000", "pod a*b>c", "dynamo-1-dp2"):
        subject = subject_for("prefixscope.kv", name)
        assert subject.count(".") == 2 and not set(subject) & set(" *>")
        assert worker_from_subject("prefixscope.kv", subject) == name
    assert worker_from_subject("prefixscope.kv", "other.w0") is None


def test_commands_are_registered_and_the_relay_loads_no_fleet() -> None:
    assert SUBCOMMANDS["relay"][0] == "exporter.relay" and SUBCOMMANDS["shard-plan"][0] == "exporter.shard_plan"
    loaded = loaded_packages("exporter.relay")
    assert "fleet" not in loaded and "lab" not in loaded


def test_shard_plan_prints_each_shard(tmp_path, capsys) -> None:
    from exporter.shard_plan import main

    cfg = tmp_path / "exporter.yaml"
    cfg.write_text("workers:\n" + "".join(f"  - {{name: w{i}, kv_events: 'nats://n:4222'}}\n" for i in range(6))
                   + "routers:\n  - {name: r, metrics_url: 'http://r/metrics'}\n")
    assert main(["--config.file", str(cfg), "--shards", "3"]) == 0
    out = capsys.readouterr().out
    assert "shard 2" in out and "router(s): r" in out and sum(out.count(f"w{i}") for i in range(6)) == 6
