"""Real Prometheus, Alertmanager, nats-server and console processes on 127.0.0.1, started and
stopped by tests.

Prometheus is given a rule file (and, optionally, a backfilled history); Alertmanager a
configuration file; nats-server a JetStream store; the console is started as ``prefixscope console`` is, against the URLs given.
Each yields its URL once it answers and stops the process it started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests
import yaml

from console.settings import EXPORTER_ENV, PROMETHEUS_ENV, THRESHOLDS_ENV
from tests.support import free_port, require_tool, wait_for

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
ALERTMANAGER = "prometheus-alertmanager"  # Debian's name for the binary


def alerts_at_once(rules: dict) -> dict:
    """A rule file whose alerts keep their expressions but fire at once (``for: 0s``): a test cannot
    wait minutes for them, and ``for`` is Prometheus's job."""
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "0s"
    return rules


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def prometheus(workdir: Path, rules: dict, history: str | None = None,
               ready: set[str] = frozenset()) -> Iterator[str]:  # type: ignore[assignment]
    """Prometheus over ``rules`` (a parsed rule file) and ``history`` (OpenMetrics text, backfilled
    with promtool), evaluating every second; yields its URL once the alerts named in ``ready`` fire
    and their ``ALERTS`` series can be queried (at once when none are named)."""
    binary = require_tool(PROMETHEUS)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rules.yaml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    (workdir / "prometheus.yml").write_text(
        "global: {scrape_interval: 15s, evaluation_interval: 1s}\nrule_files: [rules.yaml]\n", encoding="utf-8")
    if history is not None:
        (workdir / "backfill.om").write_text(history, encoding="utf-8")
        subprocess.run([require_tool(PROMTOOL), "tsdb", "create-blocks-from", "openmetrics",
                        str(workdir / "backfill.om"), str(workdir / "data")],
                       check=True, capture_output=True, timeout=60)
    port = free_port()
    log = workdir / "prometheus.log"
    proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--storage.tsdb.retention.time=1d"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {log.read_text()[-2000:]}")
        groups = requests.get(f"{url}/api/v1/rules", timeout=5).json()["data"]["groups"]
        if not groups:
            return False
        alerts = requests.get(f"{url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        if not ready <= {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}:
            return False
        # The alerts API can say firing a moment before the ALERTS series that charts read is
        # queryable; wait for both.
        stored = requests.get(f"{url}/api/v1/query", params={"query": 'ALERTS{alertstate="firing"}'},
                              timeout=5).json()["data"]["result"]
        return ready <= {s["metric"]["alertname"] for s in stored}

    try:
        wait_for(answers, f"Prometheus with its rules loaded and {sorted(ready)} firing", 120, every=0.3,
                 ignore=(requests.RequestException, ValueError, KeyError))
        yield url
    finally:
        _stop(proc)


@contextmanager
def alertmanager(workdir: Path, config: Path) -> Iterator[str]:
    """Alertmanager over ``config`` (a configuration file), alone (no cluster peers); yields its URL
    once ``/-/ready`` answers."""
    binary = require_tool(ALERTMANAGER)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "alertmanager.log"
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"alertmanager exited: {log.read_text()[-2000:]}")
        return requests.get(f"{url}/-/ready", timeout=2).status_code == 200

    try:
        wait_for(ready, "Alertmanager to answer /-/ready", 60, every=0.2, ignore=(requests.RequestException,))
        yield url
    finally:
        _stop(proc)


def _nats_listening(store: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A nats-server started on a free port, once it listens; RuntimeError if it exits first."""
    port = free_port()
    proc = subprocess.Popen([require_tool("nats-server"), "-js", "-sd", str(store), "-p", str(port), "-a", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, "nats-server listening")
    except BaseException:
        _stop(proc)
        raise
    return proc, port


@contextmanager
def nats_server(store: Path, attempts: int = 3) -> Iterator[str]:
    """nats-server with JetStream kept in ``store``; yields its ``nats://`` URL once it listens.
    A server that exits before it listens (its free port taken in the meantime by another process
    on a shared machine) is started again on another port, ``attempts`` times in all."""
    log = store.parent / f"{store.name}-nats-server.log"
    for attempt in range(attempts):
        try:
            proc, port = _nats_listening(store, log)
            break
        except RuntimeError:
            if attempt + 1 == attempts:
                raise
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        _stop(proc)


@contextmanager
def console(exporter_url: str, prometheus_url: str | None = None,
            thresholds: Path | None = None) -> Iterator[str]:
    """``prefixscope console`` against these URLs; yields its URL once Streamlit is healthy."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (EXPORTER_ENV, PROMETHEUS_ENV, THRESHOLDS_ENV)}
    cmd = [sys.executable, "-m", "prefixscope", "console", "--exporter-url", exporter_url, "--port", str(port)]
    if prometheus_url is not None:
        cmd += ["--prometheus-url", prometheus_url]
    if thresholds is not None:
        cmd += ["--thresholds", str(thresholds)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "console exited"
            return requests.get(f"{url}/_stcore/health", timeout=5).text == "ok"

        wait_for(healthy, "the console to answer /_stcore/health", timeout=120, every=0.2,
                 ignore=(requests.RequestException,))
        yield url
    finally:
        _stop(proc)
