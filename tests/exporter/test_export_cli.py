"""``prefixscope export`` as a process: exit codes and messages, start-up log, clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from exporter import main as export_main
from prefixscope.thresholds import DEFAULT_PATH as DEFAULT_THRESHOLDS
from tests.support import read_until, wait_for

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixscope", "export", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=60)


def test_bad_config_exits_2_with_one_clear_line(tmp_path: Path) -> None:
    cfg = tmp_path / "exporter.yaml"
    cfg.write_text("workers:\n  - {name: a, metrics_url: http://h/m}\n  - {name: b, metrics_url: http://h/m}\n"
                   "  - {name: c, metrics_url: foo}\n")
    r = run_export("--config.file", str(cfg))
    assert r.returncode == 2
    assert r.stderr.startswith('prefixscope export: exporter.yaml: workers[2].metrics_url: expected an http:// or https:// URL, got "foo"')
    assert r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("setting", "where"), [
    ("otlp:\n  session_wait: 2.0s\n", "otlp.session_wait"),
    ("records:\n  ts_tolerance: 1.5m\n", "records.ts_tolerance"),
    ("limits:\n  label_idle: 10 min\n", "limits.label_idle"),
    ("web:\n  read_timeout: 5sec\n", "web.read_timeout"),
])
def test_every_nested_duration_is_a_one_line_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          setting: str, where: str) -> None:
    """A duration outside the one grammar, in any section, exits 2 on one line naming the setting."""
    (tmp_path / "exporter.yaml").write_text(setting)
    assert export_main.main(["--config.file", str(tmp_path / "exporter.yaml"), "--web.listen-address", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert f"exporter.yaml: {where}: expected a positive number of seconds or a duration" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--config.file", "/nonexistent/exporter.yaml"], "exporter.yaml: cannot read"),
    (["--web.listen-address", "nowhere"], '--web.listen-address: not HOST:PORT: "nowhere"'),
    (["--log.level", "loud"], "invalid choice: 'loud'"),
])
def test_bad_flags_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert export_main.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bad_topology_and_manifest_are_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "topo.yaml").write_text("workers: 3\n")
    (tmp_path / "exporter.yaml").write_text("topology: topo.yaml\n")
    assert export_main.main(["--config.file", str(tmp_path / "exporter.yaml"), "--web.listen-address", "127.0.0.1:0"]) == 2
    assert "exporter.yaml: topology:" in capsys.readouterr().err
    (tmp_path / "exporter.yaml").write_text("fleet_manifest: missing.json\n")
    assert export_main.main(["--config.file", str(tmp_path / "exporter.yaml"), "--web.listen-address", "127.0.0.1:0"]) == 2
    assert "exporter.yaml: fleet_manifest: cannot read" in capsys.readouterr().err


def test_address_in_use_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert export_main.main(["--web.listen-address", f"127.0.0.1:{port}"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_help_exits_0() -> None:
    r = run_export("--help")
    assert r.returncode == 0 and "--web.listen-address" in r.stdout and "--config.file" in r.stdout


def start_export(cfg: Path) -> tuple[subprocess.Popen[str], str, str]:
    """``prefixscope export --config.file cfg`` on a free port → (process, its URL, its log so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "export", "--config.file", str(cfg),
                             "--web.listen-address", "127.0.0.1:0"], cwd=REPO, env=ENV,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        url = read_until(proc.stderr, r"listening on (http://127\.0\.0\.1:\d+)", lines).group(1)
    except BaseException:
        stop(proc)
        raise
    return proc, url, "".join(lines)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serves_logs_targets_and_stops_on_sigterm(tmp_path: Path) -> None:
    cfg = tmp_path / "exporter.yaml"
    # Targets on a port nobody listens on: the exporter must still start and report them down.
    cfg.write_text("scrape_interval: 1s\nscrape_timeout: 500ms\n"
                   "workers:\n  - {name: w0, metrics_url: 'http://127.0.0.1:9/metrics'}\n"
                   "routers:\n  - {name: gw, metrics_url: 'http://127.0.0.1:9/metrics', kind: vllm-router}\n")
    proc, url, log = start_export(cfg)
    try:
        assert "worker w0: metrics http://127.0.0.1:9/metrics" in log
        assert "router gw (vllm-router): metrics http://127.0.0.1:9/metrics" in log
        down = ('prefixscope_up{kind="worker",target="w0"} 0.0', 'prefixscope_up{kind="router",target="gw"} 0.0')
        # worker and router are scraped concurrently: wait for both results
        wait_for(lambda: all(d in requests.get(url + "/metrics", timeout=5).text for d in down),
                 "both targets reported down", timeout=120, every=0.1)
        landing = requests.get(url + "/", timeout=5).text
        assert "<b>down</b>" in landing and "w0" in landing
        proc.send_signal(signal.SIGTERM)
        # Its loops wake every half second or sooner; a hang (not a slow machine) misses this.
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)


def test_a_thresholds_window_of_1h30m_starts_the_exporter(tmp_path: Path) -> None:
    """Every duration the threshold file accepts, the exporter runs with (one grammar)."""
    data = yaml.safe_load(DEFAULT_THRESHOLDS.read_text(encoding="utf-8"))
    data["window"] = "1h30m"
    (tmp_path / "thresholds.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg = tmp_path / "exporter.yaml"
    cfg.write_text("thresholds: thresholds.yaml\n")
    proc, url, _log = start_export(cfg)
    try:
        groups = requests.get(url + "/api/v1/groups", timeout=10).json()["data"]
        assert groups["window_s"] == 5400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)
