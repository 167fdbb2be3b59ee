"""``prefixscope sim``: listing, accelerated runs, bad input, and the real-time fleet."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from fleet.cli import main
from fleet.records import schema_errors
from fleet.scenarios import preset_names
from fleet.simulation import with_block_size
from fleet.topology import DEFAULT_TOPOLOGY, load_topology
from tests.fleet.test_records import RecordReceiver
from tests.support import wait_for

REPO = Path(__file__).resolve().parents[2]


def test_list_scenarios_shows_every_preset_with_its_step(capsys) -> None:
    assert main(["--list-scenarios"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        assert name in out
    line = next(x for x in out.splitlines() if x.startswith("worker-failures"))
    assert " 2 " in line and "PrefixSessionMigrationsHigh" in line


def test_accelerated_run_prints_the_signal_table_and_writes_records(tmp_path: Path, capsys) -> None:
    records = tmp_path / "records.ndjson"
    from lab.sim import main as sim_main  # the fleet composed with the threshold file and the recount

    rc = sim_main(["--accelerated", "--scenario", "slow-tree-walk", "--duration", "400", "--workers", "4",
                   "--records-file", str(records)])
    assert rc == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("prefix_tree_walk_latency"))
    assert row.endswith("! <- expected")  # crossed after the fault, and it is the expected check
    lines = records.read_text().splitlines()
    assert len(lines) > 200
    recs = [json.loads(x) for x in lines]
    assert {r["worker"] for r in recs} <= {"w0", "w1", "w2", "w3"}
    assert schema_errors(recs[-1]) == []


def test_bad_topology_and_unknown_scenario_stop_with_a_clear_message(tmp_path: Path, capsys) -> None:
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    data["workers"][3]["prefill_tps"] = "fast"
    bad = tmp_path / "topology.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["--accelerated", "--topology", str(bad)]) == 2
    assert 'topology.yaml: workers[3].prefill_tps: expected a positive number, got "fast"' in capsys.readouterr().err
    assert main(["--accelerated", "--scenario", "no-such-fault"]) == 2
    assert "no-such-fault: unknown scenario" in capsys.readouterr().err


def test_a_bad_trace_line_is_reported_and_the_rest_replayed(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    good = [{"timestamp": i * 1000, "input_length": 2000, "output_length": 20, "hash_ids": [1, 2, 3, 4]}
            for i in range(30)]
    trace.write_text("\n".join([json.dumps(g) for g in good[:10]] + ["{oops"] + [json.dumps(g) for g in good[10:]]))
    assert main(["--accelerated", "--trace", str(trace), "--policy", "prefix-tree"]) == 0
    captured = capsys.readouterr()
    assert "trace.jsonl: line 11: not JSON" in captured.err
    assert "30 requests" in captured.out


def _sim(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prefixscope", "sim", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc: subprocess.Popen) -> dict:
    def written() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "the fleet exited"
        return path.exists()

    wait_for(written, "the fleet to write its manifest", timeout=120, every=0.1)
    return json.loads(path.read_text())


def test_real_time_fleet_serves_workers_and_posts_records(tmp_path: Path) -> None:
    rx = RecordReceiver()
    manifest = tmp_path / "fleet.json"
    # 60 simulated seconds at 30x: about two seconds of wall time, then it stops by itself
    proc = _sim("--scenario", "healthy", "--speed", "30", "--duration", "60", "--workers", "3",
                "--records-url", rx.url, "--manifest", str(manifest), "--metrics-flavour", "vllm-legacy",
                "--router-metrics", "vllm-router")
    try:
        data = _wait_for(manifest, proc)
        assert [w["name"] for w in data["workers"]] == ["w0", "w1", "w2"]
        metrics = urllib.request.urlopen(data["workers"][1]["url"] + "/metrics", timeout=5).read().decode()
        assert "vllm:gpu_prefix_cache_queries_total" in metrics  # the flavour switch reached the workers
        # the reference router serves its own /metrics in vllm-router's names, workers labelled by URL
        assert data["router"]["flavour"] == "vllm-router"
        page = urllib.request.urlopen(data["router"]["metrics_url"], timeout=5).read().decode()
        for w in data["workers"]:
            assert f'vllm_router_worker_health{{worker="{w["url"]}"}} 1' in page
        topo = yaml.safe_load(Path(data["topology"]).read_text())
        assert [w["name"] for w in topo["workers"]] == ["w0", "w1", "w2"]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        rx.close()
    recs = [json.loads(x) for x in rx.lines]
    assert len(recs) > 20 and all(schema_errors(r | {"block_hashes": r["block_hashes"][:4]}) == [] for r in recs)
    ts = [r["ts"] for r in recs]
    assert abs(ts[0] - time.time()) < 600  # real-time records carry wall-clock timestamps


def test_no_traffic_serves_until_sigterm_and_stops_cleanly(tmp_path: Path) -> None:
    manifest = tmp_path / "fleet.json"
    proc = _sim("--no-traffic", "--workers", "2", "--manifest", str(manifest), "--event-encoding", "map")
    try:
        data = _wait_for(manifest, proc)
        health = urllib.request.urlopen(data["workers"][0]["url"] + "/health", timeout=5)
        assert health.status == 200
        # the real-time fleet (the demo's) runs as vLLM with --kv-cache-metrics: present, empty until a cache evicts
        metrics = urllib.request.urlopen(data["workers"][0]["url"] + "/metrics", timeout=5).read().decode()
        assert 'vllm:kv_block_idle_before_evict_seconds_count{engine="0",model_name=' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert "serving workers only" in out and "w1: http://127.0.0.1:" in out


def test_without_kv_cache_metrics_the_workers_serve_no_residency(tmp_path: Path) -> None:
    manifest = tmp_path / "fleet.json"
    proc = _sim("--no-traffic", "--workers", "1", "--manifest", str(manifest), "--no-kv-cache-metrics")
    try:
        data = _wait_for(manifest, proc)
        metrics = urllib.request.urlopen(data["workers"][0]["url"] + "/metrics", timeout=5).read().decode()
        assert "vllm:prefix_cache_queries_total" in metrics and "kv_block_" not in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- steady state: `prefixscope steady` runs through the exporter (lab.steady) ----------------------
def test_warmup_json_prints_the_exporters_verdict_before_and_during_the_fault(capsys) -> None:
    from prefixscope.cli import main as prefixscope_main

    rc = prefixscope_main(["steady", "--scenario", "slow-tree-walk", "--warmup", "1m", "--workers", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["scenario"], out["warmup_s"], out["fault_at_s"], out["end_s"]) == ("slow-tree-walk", 60, 360, 660)
    assert out["warmup"]["at"] == 345 and out["fault"]["at"] == 660
    assert out["warmup"]["verdict"]["step"] is None and out["warmup"]["firing"] == []
    assert out["fault"]["verdict"]["step"] == 4 and "prefix_tree_walk_latency" in out["fault"]["firing"]
    assert "instantaneous" in out["evaluation"]
    assert set(out["cache_fill"]) == {"w0", "w1", "w2", "w3"}


def test_a_bad_warmup_is_named_and_sim_says_where_the_verdict_is(capsys) -> None:
    from prefixscope.cli import main as prefixscope_main

    assert prefixscope_main(["steady", "--warmup", "two hours"]) == 2
    assert "prefixscope steady: --warmup" in capsys.readouterr().err
    # the fleet alone never imports the exporter: it says which command reads the verdict
    for argv in (["--accelerated", "--warmup", "2h"], ["--json"]):
        assert prefixscope_main(["sim", *argv]) == 2
        assert "prefixscope steady --warmup" in capsys.readouterr().err


def test_a_trace_replay_keeps_the_topologys_kv_tokens_in_trace_blocks(tmp_path: Path, capsys) -> None:
    """64 engine blocks of 16 tokens hold two 512-token Mooncake blocks, not 64 of them."""
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    for cls in data["gpu_classes"].values():
        cls["kv_blocks"] = 64
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump(data))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i * 1000, "input_length": 2048, "output_length": 8,
                                           "hash_ids": [4 * i + k for k in range(4)]}) for i in range(10)))
    assert main(["--accelerated", "--trace", str(trace), "--topology", str(topo), "--workers", "1",
                 "--duration", "60"]) == 0
    # the run's caches were sized in trace blocks from the topology's tokens: 64 × 16 = 2 × 512
    assert with_block_size(load_topology(topo), 512).workers[0].kv_blocks == 2
