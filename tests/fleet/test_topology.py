"""The topology file: the default fleet's shape and readable errors for bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleet.cli import router_flavour
from fleet.topology import DEFAULT_TOPOLOGY, TopologyError, load_topology, parse_topology


def _default_data() -> dict:
    return yaml.safe_load(DEFAULT_TOPOLOGY.read_text())


def _write(tmp_path: Path, data: object, name: str = "bad.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def test_default_fleet_is_heterogeneous_multi_node_with_a_warm_pool() -> None:
    t = load_topology()
    assert len(t.workers) == 8
    assert set(t.nodes) == {"node-a", "node-b"}
    for node in t.nodes:
        assert len({w.nvlink_domain for w in t.workers if w.node == node}) == 2
    assert 1 <= len(t.warm_pool) <= 2
    classes = {w.gpu_class: w.prefill_tps for w in t.workers}
    assert set(classes) == {"H100", "A100"}
    # a healthy fleet must not trip the cold-prefill alert (p99 cold vs p50 warm < 3x)
    assert max(classes.values()) / min(classes.values()) < 3


def test_worker_fields_override_their_gpu_class() -> None:
    t = load_topology()
    w0, w1 = t.worker("w0"), t.worker("w1")
    assert (w0.warm_pool, w0.max_concurrency) == (True, 16)
    assert (w1.warm_pool, w1.max_concurrency) == (False, 48)
    assert w1.kv_blocks == 64000 and w1.price_per_gpu_hour == 4.0 and w1.gpus == 2


def test_transfer_time_uses_nvlink_within_a_node_and_the_network_across() -> None:
    t = load_topology()
    tokens = 10_000
    # 10k tokens x 81920 B = 819.2 MB; NVLink 450 GB/s within node-a, 25 GB/s (the slower side) across
    assert t.transfer_seconds(tokens, "w1", "w2") == pytest.approx(0.8192 / 450)
    assert t.transfer_seconds(tokens, "w1", "w5") == pytest.approx(0.8192 / 25)


def test_with_workers_shrinks_or_grows_the_fleet() -> None:
    t = load_topology()
    assert t.with_workers(3).names == ("w0", "w1", "w2")
    grown = t.with_workers(10)
    assert grown.names[8:] == ("w0-r1", "w1-r1")
    assert grown.worker("w1-r1").node == "node-a-r1" and grown.worker("w1-r1").gpu_class == "H100"
    with pytest.raises(TopologyError, match="--workers must be positive"):
        t.with_workers(0)


def test_as_dict_round_trips_through_the_validator() -> None:
    t = load_topology().with_workers(5)
    again = parse_topology(t.as_dict(), "roundtrip.yaml")
    assert again.workers == t.workers and again.model == t.model


def test_bad_value_names_file_field_and_problem(tmp_path: Path) -> None:
    data = _default_data()
    data["workers"][3]["prefill_tps"] = "fast"
    with pytest.raises(TopologyError) as e:
        load_topology(_write(tmp_path, data, "topology.yaml"))
    assert str(e.value) == 'topology.yaml: workers[3].prefill_tps: expected a positive number, got "fast"'


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda d: d["workers"][2].update(gpu_class="B200"),
     'bad.yaml: workers[2].gpu_class: unknown GPU class "B200" (defined: A100, H100)'),
    (lambda d: d["workers"][1].update(nvlink_domain="node-b/nvl0"),
     'bad.yaml: workers[4].nvlink_domain: domain "node-b/nvl0" is on node "node-a" (workers[1]); an NVLink domain cannot span nodes'),
    (lambda d: d["workers"][5].update(name="w4"), 'bad.yaml: workers[5].name: duplicate worker name "w4"'),
    (lambda d: d["workers"][0].update(warm_pool="yes"), 'bad.yaml: workers[0].warm_pool: expected true or false, got "yes"'),
    (lambda d: d["workers"][0].update(gpus=1.5), "bad.yaml: workers[0].gpus: expected a positive integer, got 1.5"),
    (lambda d: d["gpu_classes"]["A100"].update(kv_blocks=-1),
     "bad.yaml: gpu_classes.A100.kv_blocks: expected a positive integer, got -1"),
    (lambda d: d["workers"][0].update(colour="red"), "bad.yaml: workers[0].colour: unknown field (allowed: name, node, "),
    (lambda d: d["workers"][6].pop("node"), "bad.yaml: workers[6].node: missing"),
    (lambda d: d.update(workers=[]), "bad.yaml: workers: expected a non-empty list, got []"),
])
def test_each_problem_is_reported_with_its_field(tmp_path: Path, mutate, expected: str) -> None:
    data = _default_data()
    mutate(data)
    with pytest.raises(TopologyError) as e:
        load_topology(_write(tmp_path, data))
    assert expected in str(e.value)


def test_a_missing_capability_names_the_worker_and_where_to_set_it(tmp_path: Path) -> None:
    data = _default_data()
    del data["gpu_classes"]["A100"]["decode_tps"]
    with pytest.raises(TopologyError) as e:
        load_topology(_write(tmp_path, data))
    lines = str(e.value).splitlines()
    assert "bad.yaml: workers[4].decode_tps: missing (the simulator needs it; set it on the worker or on gpu_classes.A100)" in lines
    assert len(lines) == 4  # one line per A100 worker: every problem is reported at once


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"^nope.yaml: cannot read file"):
        load_topology(tmp_path / "nope.yaml")
    with pytest.raises(TopologyError, match=r"^bad.yaml: line \d+: not valid YAML"):
        load_topology(_write(tmp_path, "model: x\nworkers: [\n"))
    with pytest.raises(TopologyError, match=r"^bad.yaml: \(top level\): expected a mapping, got \[1\]"):
        load_topology(_write(tmp_path, "- 1\n"))


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    data = _default_data()
    data["block_size"] = 0
    data["workers"][1]["gpus"] = "two"
    data["workers"][2]["gpu_class"] = "B200"
    data["workers"][5]["nvlink_domain"] = "node-a/nvl0"
    del data["workers"][7]["name"]
    data["gpu_classes"]["H100"]["prefill_tps"] = -5
    with pytest.raises(TopologyError) as e:
        load_topology(_write(tmp_path, data, "topology.yaml"))
    assert set(e.value.problems) == {
        "topology.yaml: block_size: expected a positive integer, got 0",
        'topology.yaml: workers[1].gpus: expected a positive integer, got "two"',
        'topology.yaml: workers[2].gpu_class: unknown GPU class "B200" (defined: A100, H100)',
        'topology.yaml: workers[5].nvlink_domain: domain "node-a/nvl0" is on node "node-a" (workers[0]); '
        "an NVLink domain cannot span nodes",
        "topology.yaml: workers[7].name: missing",
        "topology.yaml: gpu_classes.H100.prefill_tps: expected a positive number, got -5",
    }


def test_placement_alone_is_a_valid_topology_file() -> None:
    """A real cluster's file may leave out every simulator capability; the exporter needs none."""
    t = parse_topology({"model": "m", "workers": [{"name": "a", "node": "n", "nvlink_domain": "n/0", "gpu_class": "H100"}]},
                       "real.yaml")
    w = t.worker("a")
    assert (w.gpus, w.warm_pool, w.prefill_tps, w.kv_blocks) == (1, False, None, None)
    with pytest.raises(TopologyError, match=r"^real.yaml: workers\[0\].prefill_tps: missing \(the simulator needs it"):
        t.require_simulator_fields()


def test_router_metrics_flavour_comes_from_the_command_line_else_the_topology(tmp_path: Path) -> None:
    data = _default_data() | {"router_metrics": "llm-d"}
    t = load_topology(_write(tmp_path, data, "llmd.yaml"))
    assert t.router_metrics == "llm-d" and parse_topology(t.as_dict()).router_metrics == "llm-d"
    assert router_flavour(None, t) == "llm-d" and router_flavour("none", t) == "none"
    assert router_flavour(None, load_topology()) == "sglang"  # the demo's default
    with pytest.raises(TopologyError, match="router_metrics"):
        load_topology(_write(tmp_path, _default_data() | {"router_metrics": "nginx"}))
