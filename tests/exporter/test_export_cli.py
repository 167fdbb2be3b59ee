"""``prefixscope export`` as a process: exit codes and messages, start-up log, clean shutdown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from exporter import main as export_main

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


def test_serves_logs_targets_and_stops_on_sigterm(tmp_path: Path) -> None:
    cfg = tmp_path / "exporter.yaml"
    # Targets on a port nobody listens on: the exporter must still start and report them down.
    cfg.write_text("scrape_interval: 1s\nscrape_timeout: 500ms\n"
                   "workers:\n  - {name: w0, metrics_url: 'http://127.0.0.1:9/metrics'}\n"
                   "routers:\n  - {name: gw, metrics_url: 'http://127.0.0.1:9/metrics', kind: vllm-router}\n")
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "export", "--config.file", str(cfg),
                             "--web.listen-address", "127.0.0.1:0"], cwd=REPO, env=ENV,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        log = "".join(lines)
        assert "worker w0: metrics http://127.0.0.1:9/metrics" in log
        assert "router gw (vllm-router): metrics http://127.0.0.1:9/metrics" in log
        for _ in range(150):  # generous: CI machines are busy; the scrape interval is 1 s
            text = requests.get(url + "/metrics", timeout=5).text
            # worker and router are scraped concurrently: wait for both results
            if ('prefixscope_up{kind="worker",target="w0"} 0.0' in text
                    and 'prefixscope_up{kind="router",target="gw"} 0.0' in text):
                break
            time.sleep(0.1)
        assert 'prefixscope_up{kind="worker",target="w0"} 0.0' in text
        assert 'prefixscope_up{kind="router",target="gw"} 0.0' in text
        landing = requests.get(url + "/", timeout=5).text
        assert "<b>down</b>" in landing and "w0" in landing
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5.0, "shutdown should take a second or two"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
