"""Config loading: valid files become frozen dataclasses, every problem names file and field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from exporter.config import (
    PACKAGED_THRESHOLDS,
    ROUTER_KINDS,
    SCHEMA_FILE,
    ConfigError,
    load_config,
    parse_duration,
)
from prefixscope import SCHEMAS_DIR


def write(tmp_path: Path, text: str, name: str = "exporter.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


FULL = """
workers:
  - name: w0
    metrics_url: http://127.0.0.1:8001/metrics
    kv_events: tcp://127.0.0.1:5557
    replay: tcp://127.0.0.1:5558
    topic: kv
  - name: w1
    metrics_url: http://127.0.0.1:8002/metrics
    optional: true
routers:
  - name: gw
    metrics_url: http://127.0.0.1:29000/metrics
    kind: sglang-router
    max_tree_size: 1048576
records:
  http: {enabled: true, bearer_token_file: token.txt, max_body_bytes: 1024}
  file: {paths: [records.ndjson]}
topology: topo.yaml
scrape_interval: 2s
scrape_timeout: 500ms
window: 1m
"""


def test_full_config_is_parsed_into_frozen_values(tmp_path: Path) -> None:
    (tmp_path / "token.txt").write_text("s3cret\n")
    (tmp_path / "topo.yaml").write_text("workers: {}\n")
    cfg = load_config(write(tmp_path, FULL))
    assert [w.name for w in cfg.workers] == ["w0", "w1"]
    w0 = cfg.workers[0]
    assert (w0.kv_events, w0.replay, w0.topic, w0.optional) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv", False)
    assert cfg.workers[1].optional is True and cfg.workers[1].kv_events is None
    assert (cfg.routers[0].kind, cfg.routers[0].max_tree_size) == ("sglang-router", 1048576)
    assert cfg.http_records.bearer_token == "s3cret"  # read from the file, newline stripped
    assert cfg.http_records.max_body_bytes == 1024
    assert cfg.file_records.paths == (tmp_path / "records.ndjson",)  # relative to the config file
    assert cfg.topology == tmp_path / "topo.yaml"
    assert cfg.thresholds == PACKAGED_THRESHOLDS
    assert (cfg.scrape_interval, cfg.scrape_timeout, cfg.window) == (2.0, 0.5, 60.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 1.0  # type: ignore[misc]


def test_defaults_and_flag_overrides(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "{}\n"))
    assert (cfg.listen_address, cfg.scrape_interval, cfg.window) == ("127.0.0.1:9400", 5.0, None)
    assert cfg.tree_stats_interval == 1.0
    assert load_config(write(tmp_path, "tree_stats_interval: 250ms\n")).tree_stats_interval == 0.25
    assert cfg.http_records.enabled and cfg.http_records.bearer_token is None
    over = cfg.with_overrides(listen_address="127.0.0.1:0", log_level=None)
    assert over.listen_address == "127.0.0.1:0" and over.log_level == "info"


@pytest.mark.parametrize(("text", "message"), [
    ("workers:\n  - {name: a, metrics_url: http://h/metrics}\n  - {name: b, metrics_url: http://h/metrics}\n"
     "  - {name: c, metrics_url: foo}\n",
     'exporter.yaml: workers[2].metrics_url: expected an http:// or https:// URL, got "foo"'),
    ("workers:\n  - {metrics_url: http://h/metrics}\n", "exporter.yaml: workers[0].name: missing"),
    ("workers:\n  - {name: a}\n", "exporter.yaml: workers[0]: needs metrics_url or kv_events"),
    ("workers:\n  - {name: a, kv_events: http://h:1}\n", 'exporter.yaml: workers[0].kv_events: expected a ZMQ endpoint (tcp://, ipc://, inproc://) or a NATS URL (nats://, tls://), got "http://h:1"'),
    ("workers:\n  - {name: a, metrics_url: http://h/m, replay: tcp://h:2}\n",
     "exporter.yaml: workers[0].replay: replay needs kv_events"),
    ("workers:\n  - {name: a, metrics_url: http://h/m}\n  - {name: a, metrics_url: http://h/m}\n",
     'exporter.yaml: workers[1].name: duplicate worker name "a"'),
    ("workers:\n  - {name: a, metrics_url: http://h/m, colour: red}\n",
     "exporter.yaml: workers[0].colour: unknown field (allowed: name, metrics_url, "),
    ("routers:\n  - {name: r, metrics_url: http://h/m, kind: nginx}\n",
     'exporter.yaml: routers[0].kind: expected one of auto, sglang-router, vllm-router, dynamo, llm-d, got "nginx"'),
    ("routers:\n  - {name: r, metrics_url: http://h/m, max_tree_size: 0}\n",
     "exporter.yaml: routers[0].max_tree_size: "),
    ("scrape_interval: soon\n", 'exporter.yaml: scrape_interval: expected a positive number of seconds or a duration like 500ms, 5m or 1h30m, got "soon"'),
    ("scrape_interval: 1s\nscrape_timeout: 2s\n", "exporter.yaml: scrape_timeout: 2s exceeds scrape_interval 1s"),
    ("tree_stats_interval: 0\n", "exporter.yaml: tree_stats_interval: expected a positive number of seconds or a duration like 500ms, 5m or 1h30m, got 0"),
    ("records: {http: {max_body_bytes: -5}}\n", "exporter.yaml: records.http.max_body_bytes: expected a positive integer, got -5"),
    ("records: {http: {bearer_token_file: nope.txt}}\n", 'exporter.yaml: records.http.bearer_token_file: file not found: "nope.txt"'),
    ("records: {http: {bearer_token: a, bearer_token_file: nope.txt}}\n", "exporter.yaml: records.http.bearer_token_file: file not found"),
    ("topology: missing.yaml\n", 'exporter.yaml: topology: file not found: "missing.yaml"'),
    ("wokers: []\n", "exporter.yaml: wokers: unknown field (allowed: workers, fleet_manifest, "),
    ("- just\n- a list\n", 'exporter.yaml: (top level): expected a mapping, got ["just", "a list"]'),
    ("workers: [\n", "exporter.yaml: line 2: not valid YAML"),
])
def test_bad_config_names_file_field_and_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert any(line.startswith(message) for line in err.value.problems), str(err.value)


def test_token_and_token_file_together_are_refused(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"records.http: set bearer_token or bearer_token_file, not both"):
        load_config(write(tmp_path, "records: {http: {bearer_token: a, bearer_token_file: t.txt}}\n"))


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


@pytest.mark.parametrize(("value", "seconds"), [(5, 5.0), (0.25, 0.25), ("500ms", 0.5), ("2s", 2.0), ("5m", 300.0), ("1h", 3600.0)])
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["0s", -1, "5 minutes", True])
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


def test_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "exporter.yaml"
    cfg = load_config(example)
    assert cfg.workers or cfg.fleet_manifest is not None


def test_every_problem_is_reported_at_once_with_file_and_path(tmp_path: Path) -> None:
    text = """
workers:
  - {name: a, metrics_url: http://h/m}
  - {name: a, metrics_url: ftp://h/m, optional: maybe}
  - {name: c}
routers:
  - {metrics_url: http://h/m, kind: nginx}
records: {http: {bearer_token: t, bearer_token_file: t.txt, max_body_bytes: 1.5}}
topology: nowhere.yaml
scrape_interval: 1s
scrape_timeout: 2s
window: soon
colour: red
"""
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    durations = "a positive number of seconds or a duration like 500ms, 5m or 1h30m"
    assert set(err.value.problems) == {
        "exporter.yaml: colour: unknown field (allowed: workers, fleet_manifest, routers, records, otlp, topology, "
        "thresholds, scrape_interval, scrape_timeout, tree_stats_interval, breach_interval, prefix_text, state_file, "
        "state_interval, attribution, eviction_memory, window, limits, web, kv_nats, shard, worker_down_grace, discovery)",
        'exporter.yaml: workers[1].metrics_url: expected an http:// or https:// URL, got "ftp://h/m"',
        'exporter.yaml: workers[1].optional: expected true or false, got "maybe"',
        'exporter.yaml: workers[1].name: duplicate worker name "a"',
        "exporter.yaml: workers[2]: needs metrics_url or kv_events (or both)",
        "exporter.yaml: routers[0].name: missing",
        'exporter.yaml: routers[0].kind: expected one of auto, sglang-router, vllm-router, dynamo, llm-d, got "nginx"',
        "exporter.yaml: records.http.max_body_bytes: expected a positive integer, got 1.5",
        "exporter.yaml: records.http: set bearer_token or bearer_token_file, not both",
        'exporter.yaml: topology: file not found: "nowhere.yaml"',
        f'exporter.yaml: window: expected {durations}, got "soon"',
        "exporter.yaml: scrape_timeout: 2s exceeds scrape_interval 1s",
    }


def test_durations_take_the_prometheus_grammar_or_plain_seconds(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "scrape_interval: 1h30m\nscrape_timeout: 1m30s\ntree_stats_interval: 2.5\n"
                                      "window: 1d\n"))
    assert (cfg.scrape_interval, cfg.scrape_timeout, cfg.tree_stats_interval, cfg.window) == (5400.0, 90.0, 2.5, 86400.0)
    assert load_config(write(tmp_path, "breach_interval: 2s\n")).breach_interval == 2.0
    assert load_config(write(tmp_path, "")).breach_interval == 5.0


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")).workers == ()


def test_the_schema_knows_the_router_kinds() -> None:
    schema = json.loads((SCHEMAS_DIR / SCHEMA_FILE).read_text())
    assert tuple(schema["$defs"]["router"]["properties"]["kind"]["enum"]) == ROUTER_KINDS


def test_attribution_is_on_by_default_and_bounded_by_the_limits(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "{}\n"))
    assert cfg.attribution and (cfg.limits.adapters, cfg.limits.tenants) == (20, 50)
    assert cfg.otlp.adapter_attributes == () and cfg.otlp.tenant_attributes == ()
    cfg = load_config(write(tmp_path, """attribution: false
limits: {adapters: 3, tenants: 7}
otlp: {adapter_attributes: [gen_ai.request.model], tenant_attributes: [tenant.id]}
"""))
    assert not cfg.attribution and (cfg.limits.adapters, cfg.limits.tenants) == (3, 7)
    assert cfg.otlp.adapter_attributes == ("gen_ai.request.model",) and cfg.otlp.tenant_attributes == ("tenant.id",)
