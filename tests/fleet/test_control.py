"""The fleet's control endpoint over real HTTP: kill and restart a worker of a running fleet."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from fleet.clock import VirtualClock
from fleet.control import FleetControl
from fleet.scenarios import load_preset
from fleet.simulation import Simulation, worker_spec
from fleet.topology import load_topology
from fleet.workers import WorkerFleet


@pytest.fixture
def running():
    """A two-worker fleet, a simulation driving it, and a thread applying commands as the sim would."""
    clock = VirtualClock()
    topology = load_topology(None).with_workers(2)
    with WorkerFleet([worker_spec(topology, w) for w in topology.workers], clock=clock) as fleet:
        sim = Simulation(load_preset("healthy"), topology, clock=clock, fleet=fleet, track_placement=False)
        control = FleetControl(fleet).start()
        stop = threading.Event()

        def drive() -> None:
            while not stop.wait(0.02):
                control.apply(sim)
        t = threading.Thread(target=drive, daemon=True)
        t.start()
        try:
            yield fleet, sim, control
        finally:
            stop.set()
            t.join(2)
            control.stop()


def test_kill_takes_the_worker_out_of_the_pool_and_down(running):
    fleet, sim, control = running
    name = fleet.specs[0].name
    url = fleet[name].url
    r = requests.post(f"{control.url}/workers/{name}/kill", timeout=15)
    assert r.status_code == 200 and r.json() == {"worker": name, "action": "kill", "result": f"{name} killed"}
    assert not fleet[name].alive
    assert name not in sim.router.active()  # the router moved its sessions away: a migration, not a crash
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/metrics", timeout=2)
    again = requests.post(f"{control.url}/workers/{name}/kill", timeout=15)
    assert again.status_code == 409 and "already down" in again.json()["result"]
    listed = requests.get(f"{control.url}/workers", timeout=5).json()["workers"]
    assert {w["name"]: w["alive"] for w in listed} == {fleet.specs[0].name: False, fleet.specs[1].name: True}


def test_restart_brings_a_fresh_worker_back_on_the_same_port(running):
    fleet, sim, control = running
    name = fleet.specs[1].name
    url = fleet[name].url
    assert requests.post(f"{control.url}/workers/{name}/kill", timeout=15).status_code == 200
    r = requests.post(f"{control.url}/workers/{name}/restart", timeout=15)
    assert r.status_code == 200 and r.json()["result"] == f"{name} restarted"
    assert fleet[name].alive and fleet[name].url == url
    assert name in sim.router.active()
    assert sim.engines[name] is fleet[name].engine  # the simulation drives the new engine
    assert requests.get(url + "/metrics", timeout=5).status_code == 200


def _occupy(port: int) -> socket.socket:
    """Another process's listener on ``port`` (what an ephemeral port released by a dead worker risks)."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_restart_on_a_port_taken_meanwhile_binds_fresh_ports_and_the_fleet_carries_on(running):
    fleet, sim, control = running
    name, other = fleet.specs[0].name, fleet.specs[1].name
    old_url = fleet[name].url
    assert requests.post(f"{control.url}/workers/{name}/kill", timeout=15).status_code == 200
    with _occupy(int(old_url.rsplit(":", 1)[1])):
        r = requests.post(f"{control.url}/workers/{name}/restart", timeout=15)
        assert r.status_code == 200, r.text
        assert r.json()["result"].startswith(f"{name} restarted on new ports (")
        new_url = fleet[name].url
        assert new_url != old_url and fleet[name].alive and fleet.moves == 1
        assert requests.get(new_url + "/metrics", timeout=5).status_code == 200
    # the simulation routes to the new engine, the other worker never noticed, commands still work
    assert name in sim.router.active() and sim.engines[name] is fleet[name].engine
    assert fleet[other].alive and requests.get(fleet[other].url + "/health", timeout=5).status_code == 200
    listed = requests.get(f"{control.url}/workers", timeout=5).json()["workers"]
    assert {w["name"]: (w["url"], w["alive"]) for w in listed}[name] == (new_url, True)
    assert requests.post(f"{control.url}/workers/{name}/kill", timeout=15).status_code == 200


def test_a_restart_that_cannot_bind_at_all_answers_503_and_leaves_the_worker_down(running, monkeypatch):
    fleet, _, control = running
    name = fleet.specs[0].name
    assert requests.post(f"{control.url}/workers/{name}/kill", timeout=15).status_code == 200

    def no_ports(*_a, **_k):
        raise OSError(98, "Address already in use")
    monkeypatch.setattr(fleet, "_launch", no_ports)
    r = requests.post(f"{control.url}/workers/{name}/restart", timeout=15)
    assert r.status_code == 503 and "could not restart" in r.json()["result"]
    assert not fleet[name].alive and fleet[fleet.specs[1].name].alive
    monkeypatch.undo()
    assert requests.post(f"{control.url}/workers/{name}/restart", timeout=15).status_code == 200


@pytest.mark.parametrize(("path", "needle"), [
    ("/workers/nope/kill", "unknown worker 'nope'"),
    ("/workers/{w}/explode", "unknown action 'explode'"),
    ("/kill", "POST /workers/<name>/kill"),
])
def test_bad_commands_get_a_clear_404(running, path, needle):
    fleet, _, control = running
    r = requests.post(control.url + path.format(w=fleet.specs[0].name), timeout=15,
                      headers={"Content-Length": "junk"})
    assert r.status_code == 404 and needle in r.text
    assert all(w.alive for w in fleet)


def test_a_worker_killed_mid_run_is_a_hard_migration_not_a_crash():
    """The kill arrives over HTTP while the simulation routes; its sessions move hard, routing goes on."""
    clock = VirtualClock()
    topology = load_topology(None).with_workers(3)
    with WorkerFleet([worker_spec(topology, w) for w in topology.workers], clock=clock) as fleet:
        sim = Simulation(load_preset("healthy"), topology, clock=clock, fleet=fleet, track_placement=False,
                         duration_s=240)
        control = FleetControl(fleet).start()
        victim = topology.names[0]
        paused = threading.Event()
        routed = 0
        killed_at: list[float] = []

        def on_request(_record: dict | None) -> None:
            nonlocal routed
            routed += 1
            if routed == 150:  # sessions are anchored on every worker by now: hold here for the kill
                paused.set()
                deadline = time.monotonic() + 15
                while fleet[victim].alive and time.monotonic() < deadline:
                    control.apply(sim)
                    time.sleep(0.01)
                killed_at.append(clock.now())
            control.apply(sim)

        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("result", sim.run(on_request=on_request)), daemon=True)
        t.start()
        try:
            assert paused.wait(30)
            r = requests.post(f"{control.url}/workers/{victim}/kill", timeout=20)
            assert r.status_code == 200
            t.join(60)
        finally:
            control.stop()
        assert not t.is_alive() and killed_at
        after = [rec for rec in out["result"].records if rec["ts"] > killed_at[0]]
        assert after and all(rec["worker"] != victim for rec in after)
        hard = [rec for rec in after if rec["migrated_from"] == victim]
        assert hard and {rec["migration_kind"] for rec in hard} == {"hard"}


def test_a_fleet_serving_without_traffic_takes_commands_from_its_manifests_control_url(tmp_path: Path) -> None:
    manifest = tmp_path / "fleet.json"
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "sim", "--no-traffic", "--workers", "2",
                             "--manifest", str(manifest)], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not manifest.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the fleet did not start"
            time.sleep(0.1)
        data = json.loads(manifest.read_text())
        control, worker = data["control"], data["workers"][1]
        assert control.startswith("http://127.0.0.1:")
        r = requests.post(f"{control}/workers/{worker['name']}/kill", timeout=15)
        assert r.status_code == 200 and r.json()["result"] == f"{worker['name']} killed"
        with pytest.raises(requests.ConnectionError):
            requests.get(worker["url"] + "/health", timeout=2)
        assert requests.post(f"{control}/workers/{worker['name']}/restart", timeout=15).status_code == 200
        assert requests.get(worker["url"] + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_running_fleet_republishes_its_manifest_when_a_restart_moves_a_worker(tmp_path: Path) -> None:
    """Through the control endpoint of a real ``prefixscope sim``: the fleet survives, the manifest
    names the worker's new address."""
    manifest = tmp_path / "fleet.json"
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "sim", "--no-traffic", "--workers", "2",
                             "--manifest", str(manifest)], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not manifest.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the fleet did not start"
            time.sleep(0.1)
        data = json.loads(manifest.read_text())
        control, worker = data["control"], data["workers"][0]
        assert requests.post(f"{control}/workers/{worker['name']}/kill", timeout=15).status_code == 200
        with _occupy(int(worker["url"].rsplit(":", 1)[1])):
            r = requests.post(f"{control}/workers/{worker['name']}/restart", timeout=15)
            assert r.status_code == 200 and "new ports" in r.json()["result"], r.text
        assert proc.poll() is None
        deadline = time.monotonic() + 10
        while json.loads(manifest.read_text())["workers"][0]["url"] == worker["url"]:
            assert time.monotonic() < deadline, "the manifest still names the old port"
            time.sleep(0.1)
        moved = json.loads(manifest.read_text())["workers"][0]
        assert moved["name"] == worker["name"]
        assert requests.get(moved["url"] + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
