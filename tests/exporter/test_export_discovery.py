"""``prefixscope export`` as a process following a fleet that changes: a file_sd file edited while it
runs, a config changed on SIGHUP and on ``POST /-/reload``, a broken config that is refused.

Simulated workers (real HTTP /metrics, real ZMQ KV events with replay) run in the test; the exporter
is the real process, started once on a discovery file and never restarted. What is checked: a
worker added to the file is scraped and its cache indexed within a refresh; a worker removed from
the file leaves the pool and the index and never counts as a blind target (though its scrape
would fail); the prefix index survives every reload; a broken config keeps the running one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
import yaml

from fleet.engine import WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet
from tests.support import read_until, wait_for

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
MODEL = "sim-model"


@dataclass
class Exporter:
    proc: subprocess.Popen[str]
    url: str
    config: Path
    sd_file: Path
    fleet: WorkerFleet

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                out[series] = float(value)
        return out

    def value(self, series: str) -> float | None:
        return self.metrics().get(series)

    def workers(self) -> dict[str, dict]:
        data = requests.get(self.url + "/api/v1/workers", timeout=5).json()["data"]
        return {w["worker"]: w for w in data["workers"]}

    def ask(self, worker: str, text: str) -> None:
        w = self.fleet[worker]
        r = requests.post(w.url + "/v1/completions", timeout=10, json={"model": MODEL, "prompt": text, "max_tokens": 2})
        r.raise_for_status()
        wait_for(lambda: w.engine.load() == (0, 0), what=f"{worker} idle")
        w.engine.tick()
        w.publisher.flush(2.0)


def target(fleet: WorkerFleet, name: str, labels: dict[str, str] | None = None) -> dict:
    """A file_sd target group for one simulated worker, its endpoints (and ``labels``) as labels."""
    e = next(e for e in fleet.endpoints() if e["name"] == name)
    return {"targets": [urlsplit(e["url"]).netloc],
            "labels": {"worker": name, "kv_events": e["kv_endpoint"], "replay": e["replay_endpoint"],
                       "topic": e["topic"], "__meta_pool": "gpu", **(labels or {})}}


def write_sd(path: Path, fleet: WorkerFleet, names: list[str], labels: dict[str, dict[str, str]] | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([target(fleet, n, (labels or {}).get(n)) for n in names]))
    os.replace(tmp, path)  # what a script should do: the exporter never reads half a file


def write_config(path: Path, sd_file: Path, scrape_interval: str = "200ms", extra: dict | None = None) -> None:
    cfg = {"scrape_interval": scrape_interval, "scrape_timeout": "200ms",
           "discovery": {"file_sd": [{"name": "fleet", "files": [str(sd_file)],
                                      "relabel_configs": [{"source_labels": ["__meta_pool"], "regex": "gpu",
                                                           "action": "keep"}]}]}}
    path.write_text(yaml.safe_dump({**cfg, **(extra or {})}))


@contextmanager
def running(tmp_path: Path, workers: list[str], listed: list[str], labels: dict[str, dict[str, str]] | None = None,
            extra: dict | None = None) -> Iterator[Exporter]:
    """Simulated ``workers``, and the exporter process started on a file_sd file listing ``listed``
    (with their ``labels``), its config with ``extra``."""
    specs = [WorkerSpec(n, block_size=BLOCK, num_gpu_blocks=64, max_running=4) for n in workers]
    fleet = WorkerFleet(specs, options=FleetOptions(delay_scale=0.0)).start()
    sd_file, config = tmp_path / "workers.json", tmp_path / "exporter.yaml"
    write_sd(sd_file, fleet, listed, labels)
    write_config(config, sd_file, extra=extra)
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "export", "--config.file", str(config),
                             "--web.listen-address", "127.0.0.1:0", "--log.level", "info"],
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = read_until(proc.stderr, r"listening on (http://\S+)").group(1)
        yield Exporter(proc, url, config, sd_file, fleet)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        fleet.stop()


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[Exporter]:
    with running(tmp_path, ["w0", "w1", "w2"], ["w0", "w1"]) as e:
        yield e


def up(name: str) -> str:
    return f'prefixscope_up{{kind="worker",target="{name}"}}'


def resident(e: Exporter, worker: str) -> float | None:
    return e.workers().get(worker, {}).get("resident_blocks")


def test_follows_a_file_sd_file_and_reloads_keeping_its_index(exporter: Exporter) -> None:
    e = exporter
    wait_for(lambda: e.value(up("w0")) == 1 and e.value(up("w1")) == 1, what="w0 and w1 scraped", timeout=20)
    assert e.value(up("w2")) is None  # not in the file: not a target
    assert e.value('prefixscope_discovery_targets{provider="fleet"}') == 2
    e.ask("w0", "[a] " + "lorem ipsum dolor sit amet " * 20)
    wait_for(lambda: (resident(e, "w0") or 0) > 0, what="w0's blocks indexed")
    w0_blocks = resident(e, "w0")

    # A worker joins: the file changes, no signal. w2 already caches something: its replay teaches it.
    e.ask("w2", "[b] " + "consectetur adipiscing elit " * 20)
    write_sd(e.sd_file, e.fleet, ["w0", "w1", "w2"])
    wait_for(lambda: e.value(up("w2")) == 1, what="w2 scraped after the file changed", timeout=20)
    wait_for(lambda: (resident(e, "w2") or 0) == len(e.fleet["w2"].engine.cache.resident()),
             what="w2's cache indexed from its replay", timeout=20)

    # A worker leaves: it is stopped (its scrape would fail) and removed from the file.
    e.fleet.kill("w1")
    write_sd(e.sd_file, e.fleet, ["w0", "w2"])
    wait_for(lambda: e.value(up("w1")) is None, what="w1 no longer a target", timeout=20)
    assert e.value("prefixscope_telemetry_blind_targets") == 0
    assert e.workers()["w1"]["liveness"] == "left"
    assert e.value('prefixscope_discovery_targets{provider="fleet"}') == 2

    # SIGHUP: a new scrape interval applies; the index is kept.
    loaded = e.value("prefixscope_config_last_reload_success_timestamp_seconds")
    assert loaded is not None and e.value("prefixscope_config_last_reload_successful") == 1  # (at start)
    write_config(e.config, e.sd_file, scrape_interval="300ms")
    e.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: (e.value("prefixscope_config_last_reload_success_timestamp_seconds") or 0) > loaded,
             what="reloaded on SIGHUP")
    assert e.value("prefixscope_config_last_reload_successful") == 1
    before = e.value("prefixscope_config_last_reload_success_timestamp_seconds")
    assert resident(e, "w0") == w0_blocks

    # A broken config is refused: the running one stays (w0 and w2 still scraped), and it says why.
    e.config.write_text("scrape_interval: soon\n")
    r = requests.post(e.url + "/-/reload", timeout=10)
    assert r.status_code == 500 and "scrape_interval" in r.json()["error"]
    assert e.value("prefixscope_config_last_reload_successful") == 0
    assert e.value("prefixscope_config_last_reload_success_timestamp_seconds") == before
    e.proc.send_signal(signal.SIGHUP)  # the same on SIGHUP
    assert e.value(up("w0")) == 1 and e.value(up("w2")) == 1

    # POST /-/reload with a good config: the discovery relabelling now drops w2; the index keeps w0.
    write_config(e.config, e.sd_file, extra={})
    cfg = yaml.safe_load(e.config.read_text())
    cfg["discovery"]["file_sd"][0]["relabel_configs"].append({"source_labels": ["worker"], "regex": "w2",
                                                              "action": "drop"})
    e.config.write_text(yaml.safe_dump(cfg))
    r = requests.post(e.url + "/-/reload", timeout=10)
    assert r.status_code == 200, r.text
    assert e.value("prefixscope_config_last_reload_successful") == 1
    wait_for(lambda: e.value(up("w2")) is None, what="w2 dropped by the reloaded relabelling")
    assert resident(e, "w0") == w0_blocks
    assert (resident(e, "w2") or 0) == 0  # a worker that left takes its cache with it
    assert e.value("prefixscope_telemetry_blind_targets") == 0


def verdict_step(e: Exporter) -> int | None:
    v = requests.get(e.url + "/api/v1/groups", timeout=10).json()["data"]["verdict"]
    return None if v is None else v["step"]


def test_a_fleet_that_scales_out_scales_in_and_restarts_in_turn(tmp_path: Path) -> None:
    """An autoscaler driving the discovery file: scale out under load, scale in when idle, a rolling
    restart (each worker out of the file, stopped, started again with an empty cache, back in the
    file). The exporter follows with no restart: the pool and its changes track the fleet, a worker
    that left is never blind, and no step-0 verdict comes from workers that are gone."""
    names = ["w0", "w1", "w2", "w3"]
    with running(tmp_path, names, ["w0", "w1"]) as e:
        for n in ("w2", "w3"):
            e.fleet.kill(n)  # not yet scaled out: no such pods

        def pool() -> tuple[float | None, float | None]:
            m = e.metrics()
            return m.get("prefixscope_worker_pool_size"), m.get("prefixscope_worker_pool_changes_total")

        wait_for(lambda: pool()[0] == 2, what="a pool of two", timeout=20)
        for i in range(6):
            e.ask(f"w{i % 2}", f"[load {i}] " + "lorem ipsum dolor sit amet " * 12)

        # Scale out under load: two workers start and are added to the file.
        for n in ("w2", "w3"):
            e.fleet.restart(n)
        write_sd(e.sd_file, e.fleet, names)
        wait_for(lambda: pool()[0] == 4, what="the pool grows to four", timeout=20)
        for i in range(4):
            e.ask(f"w{i}", f"[after scale-out {i}] " + "consectetur adipiscing elit " * 12)
        changes = pool()[1]

        # Scale in when idle: out of the file first, then stopped (as an endpoint is removed before
        # its pod terminates).
        write_sd(e.sd_file, e.fleet, ["w0", "w1"])
        wait_for(lambda: pool()[0] == 2, what="the pool shrinks to two", timeout=20)
        for n in ("w2", "w3"):
            e.fleet.kill(n)
        assert (pool()[1] or 0) > (changes or 0)  # the pool change is seen
        assert e.value("prefixscope_telemetry_blind_targets") == 0
        assert {w: e.workers()[w]["liveness"] for w in ("w2", "w3")} == {"w2": "left", "w3": "left"}
        assert verdict_step(e) != 0

        # A rolling restart, one worker at a time.
        for n in ("w0", "w1"):
            others = [o for o in ("w0", "w1") if o != n]
            write_sd(e.sd_file, e.fleet, others)
            wait_for(lambda n=n: e.value(up(n)) is None, what=f"{n} out of the targets", timeout=20)
            e.fleet.restart(n)  # an empty cache; perhaps new ports
            write_sd(e.sd_file, e.fleet, ["w0", "w1"])
            wait_for(lambda n=n: e.value(up(n)) == 1, what=f"{n} back", timeout=20)
            assert e.value("prefixscope_telemetry_blind_targets") == 0
            e.ask(n, f"[after restart {n}] " + "sed do eiusmod tempor " * 12)
            wait_for(lambda n=n: resident(e, n) == len(e.fleet[n].engine.cache.resident()),
                     what=f"{n}'s new cache indexed", timeout=20)
        wait_for(lambda: pool()[0] == 2, what="a pool of two after the restarts", timeout=20)
        assert e.value("prefixscope_telemetry_blind_targets") == 0
        assert verdict_step(e) != 0
        assert e.value('prefixscope_discovery_refresh_failures_total{provider="fleet"}') == 0


def worker_info(e: Exporter) -> dict[str, tuple[str, str, str, str]]:
    """worker -> (node, nvlink_domain, gpu_class, warm_pool) of the exported ``prefixscope_worker_info``."""
    out = {}
    for series in e.metrics():
        if series.startswith("prefixscope_worker_info{"):
            labels = dict(kv.split("=", 1) for kv in series[len("prefixscope_worker_info{"):-1].split(","))
            labels = {k: v.strip('"') for k, v in labels.items()}
            out[labels["worker"]] = (labels["node"], labels["nvlink_domain"], labels["gpu_class"], labels["warm_pool"])
    return out


def test_discovered_topology_labels_place_the_workers_beside_the_topology_file(tmp_path: Path) -> None:
    """The file_sd labels node / nvlink_domain / gpu_class / warm_pool place each worker: exported as
    its worker_info, shown by /api/v1/workers and read by the placement judgement from KV events. The
    topology file's entry wins for a worker it names; a worker that leaves the file leaves the
    topology; a reload keeps the placement; labels that cannot place a worker are counted."""
    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump({
        "schema": "prefixscope.topology/v1", "model": MODEL, "block_size": BLOCK,
        "gpu_classes": {"H100": {"kv_blocks": 64}},
        "workers": [{"name": "w0", "node": "node-f", "nvlink_domain": "node-f/nvl0", "gpu_class": "H100"}]}))
    labels = {"w0": {"node": "node-elsewhere"},  # the file names w0: its entry wins
              "w1": {"node": "node-b", "nvlink_domain": "node-b/nvl0", "gpu_class": "H100", "warm_pool": "true"},
              "w2": {"node": "node-b", "nvlink_domain": "node-b/nvl0", "gpus": "2"},
              "w3": {"node": "node-c", "nvlink_domain": "node-f/nvl0"}}  # a domain on another node: not placed
    with running(tmp_path, ["w0", "w1", "w2", "w3"], ["w0", "w1", "w2", "w3"], labels,
                 extra={"topology": str(topology)}) as e:
        wait_for(lambda: all(e.value(up(n)) == 1 for n in ("w0", "w1", "w2", "w3")), what="all scraped", timeout=20)
        placed = {"w0": ("node-f", "node-f/nvl0", "H100", "false"),
                  "w1": ("node-b", "node-b/nvl0", "H100", "true"),
                  "w2": ("node-b", "node-b/nvl0", "unknown", "false")}
        wait_for(lambda: worker_info(e) == placed, what="the workers placed", timeout=20)
        rows = e.workers()
        assert {w: (rows[w]["node"], rows[w]["warm_pool"]) for w in ("w0", "w1", "w2", "w3")} == {
            "w0": ("node-f", False), "w1": ("node-b", True), "w2": ("node-b", False), "w3": (None, None)}
        assert e.value('prefixscope_ingest_errors_total{kind="topology",source="discovery"}') == 1
        assert rows["w1"]["capacity_blocks"] == 64

        # Placement judged from KV events by the discovered domains: w2 computes what w1 holds, in
        # w1's NVLink domain (a domain hit); then w0, in a domain of its own (no hit).
        prompt = "[shared] " + "lorem ipsum dolor sit amet " * 20
        for n in ("w1", "w2", "w0"):
            e.ask(n, prompt)
            wait_for(lambda n=n: (resident(e, n) or 0) > 0, what=f"{n}'s blocks indexed")
        decisions = f'prefixscope_kv_placement_decisions_total{{model="{MODEL}"}}'
        hits = f'prefixscope_kv_placement_domain_hits_total{{model="{MODEL}"}}'
        wait_for(lambda: e.value(decisions) == 2, what="two placements judged")
        assert e.value(hits) == 1

        # w2 leaves the file: it leaves the topology as it leaves the pool.
        write_sd(e.sd_file, e.fleet, ["w0", "w1", "w3"], labels)
        wait_for(lambda: "w2" not in worker_info(e), what="w2 out of the topology", timeout=20)
        assert e.workers()["w2"]["node"] is None

        # A relabelled topology field is no new worker: w1's warm-pool label changes, its cache stays.
        w1_blocks = resident(e, "w1")
        write_sd(e.sd_file, e.fleet, ["w0", "w1", "w3"], {**labels, "w1": {**labels["w1"], "warm_pool": "false"}})
        wait_for(lambda: worker_info(e).get("w1", ("",) * 4)[3] == "false", what="w1 out of the warm pool", timeout=20)
        assert resident(e, "w1") == w1_blocks

        # A reload keeps the placement.
        loaded = e.value("prefixscope_config_last_reload_success_timestamp_seconds") or 0
        e.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: (e.value("prefixscope_config_last_reload_success_timestamp_seconds") or 0) > loaded,
                 what="reloaded on SIGHUP")
        assert worker_info(e) == {"w0": placed["w0"], "w1": ("node-b", "node-b/nvl0", "H100", "false")}
        assert e.value(hits) == 1 and e.value(decisions) == 2
