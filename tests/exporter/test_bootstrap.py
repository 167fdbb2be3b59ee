"""The composition root: every holder of an exporter gets its parts from ``exporter.bootstrap``."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.bootstrap import bootstrap
from exporter.config import Config, ConfigError, NatsKv, RouterTarget, Shard, WorkerTarget
from exporter.core.sharding import SharedRoots
from exporter.model import RouterSnapshot
from fleet.topology import load_topology
from prefixscope.thresholds import load_thresholds, window_seconds

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_packaged_thresholds_and_their_window() -> None:
    parts = bootstrap(clock=lambda: 42.0)
    assert parts.state.health is parts.health and parts.state.thresholds is parts.thresholds
    assert parts.window_s == parts.state.window_s == window_seconds(load_thresholds())
    assert parts.topology is None and parts.state.topology is None
    assert parts.state.clock() == 42.0 and parts.sources is None
    assert any(f.name == "prefixscope_signal_available" for f in parts.collector.collect())


def test_explicit_arguments_win_over_the_config(tmp_path: Path) -> None:
    topo = load_topology()
    cfg = Config(window=60.0, thresholds=tmp_path / "absent.yaml")
    thresholds = load_thresholds()
    parts = bootstrap(cfg, thresholds=thresholds, topology=topo, window_s=1e9)
    assert parts.thresholds is thresholds and parts.state.topology is topo and parts.state.window_s == 1e9


def test_the_config_window_and_files_are_used() -> None:
    assert bootstrap(Config(window=60.0)).state.window_s == 60.0


def test_an_unusable_thresholds_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "thresholds.yaml"
    bad.write_text("checks: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"^exporter\.yaml: thresholds: "):
        bootstrap(Config(source="exporter.yaml", thresholds=bad))


def test_sources_are_built_from_the_config_but_not_started(tmp_path: Path) -> None:
    cfg = Config(workers=(WorkerTarget("w0", metrics_url="http://127.0.0.1:1/metrics"),
                          WorkerTarget("w1", kv_events="tcp://127.0.0.1:2")),
                 routers=(RouterTarget("r", "http://127.0.0.1:3/metrics"),))
    parts = bootstrap(cfg, with_sources=True)
    sources = parts.sources
    assert sources is not None and [w.name for w in sources.workers] == ["w0", "w1"]
    assert [(t.name, t.kind) for t in sources.scraper.targets] == [("w0", "worker"), ("r", "router")]
    assert sources.subscriber is not None and sources.tails == []
    assert bootstrap(Config(), with_sources=True).sources.subscriber is None  # type: ignore[union-attr]
    # Token ids are decoded only when prefix text reads them.
    assert sources.subscriber.token_ids is False
    named = bootstrap(replace(cfg, prefix_text=True), with_sources=True).sources
    assert named is not None and named.subscriber is not None and named.subscriber.token_ids is True


def test_parts_arrive_built_and_nothing_is_set_on_them_afterwards() -> None:
    """The state asks for rebuilds through the queue the subscriber takes them from; a shard that
    reads NATS judges prefix instability with the shared root tracker; configured workers are pinned."""
    cfg = Config(workers=(WorkerTarget("w0", kv_events="tcp://127.0.0.1:2", replay="tcp://127.0.0.1:3"),
                          WorkerTarget("w1", kv_events="tcp://127.0.0.1:4")))
    parts = bootstrap(cfg, with_sources=True)
    assert parts.sources is not None and parts.sources.subscriber is not None
    rebuilds = parts.sources.subscriber.rebuilds
    assert parts.state.kv.rebuild_request is rebuilds and rebuilds.replayable == {"w0"}
    assert rebuilds("w0", "over_capacity") and not rebuilds("w1", "over_capacity")  # w1 has no replay
    assert parts.state.accounting.labels.worker.pinned >= {"w0", "w1"}
    assert bootstrap(Config()).state.kv.rebuild_request is None
    nats = NatsKv(url="nats://127.0.0.1:4222")
    assert isinstance(bootstrap(Config(shard=Shard(1, 2), kv_nats=nats)).state.kv.roots, SharedRoots)
    for unshared in (Config(shard=Shard(1, 2)), Config(kv_nats=nats)):
        assert not isinstance(bootstrap(unshared).state.kv.roots, SharedRoots)


def test_a_replay_reads_over_its_whole_run() -> None:
    st = bootstrap(window_s=1e9, run_window=True).state
    st.observe_router(RouterSnapshot("r", "vllm-router"), 1000.0)
    assert st.window_s == 1.0  # at least a second
    st.observe_router(RouterSnapshot("r", "vllm-router"), 1600.0)
    assert st.window_s == 600.0


def test_nothing_but_the_bootstrap_builds_a_cluster_state() -> None:
    """Tests may build one by hand; product code asks exporter.bootstrap."""
    allowed = {Path("exporter/core/state.py"), Path("exporter/core/state_parts.py"), Path("exporter/bootstrap.py")}
    offenders = []
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "node_modules") or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            owner = getattr(getattr(node.func, "value", None), "id", None)
            if name in ("ClusterState", "build_parts") or (name == "build" and owner == "ClusterState"):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []
