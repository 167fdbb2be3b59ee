"""``prefixscope demo``: the whole product on one machine.

Starts, in order: the simulated fleet with the reference router (real time), the exporter
(reading the fleet's manifest, receiving its request records), Prometheus on 127.0.0.1 with the
generated rules (when Debian's ``prometheus`` is installed; otherwise the demo runs on the
exporter alone and says so), and the console. It prints the URLs, runs the default storyline
(healthy, then a fault every few minutes) or ``--scenario NAME``, and on Ctrl-C or SIGTERM stops
every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alerts" / "generated" / "prefixscope.rules.yaml"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def exporter_config(manifest: Path, topology: Path | None, scrape_interval: float) -> dict:
    """The exporter's config for a demo fleet described by its manifest."""
    cfg: dict = {
        "fleet_manifest": str(manifest),
        "records": {"http": {"enabled": True}},
        "scrape_interval": f"{scrape_interval:g}s",
    }
    if topology is not None:
        cfg["topology"] = str(topology)
    return cfg


def prometheus_config(exporter_address: str, rules: Path, interval_s: int = 5) -> dict:
    """A Prometheus config scraping the exporter and loading the generated rules."""
    return {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "prefixscope", "static_configs": [{"targets": [exporter_address]}]},
        ],
    }


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    """Poll ``url`` until it answers 2xx; give up early when ``proc`` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if 200 <= resp.status < 300:
                    return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


@dataclass
class Supervisor:
    """Starts child processes in their own process groups and stops all of them."""

    logs: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 — owned by the child for its lifetime
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=ROOT)
        self.procs.append((name, proc))
        return proc

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def stop(self, grace_s: float = 5.0) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _prefixscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "exporter", *args]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixscope demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default=None,
                   help="run one fault scenario (see 'prefixscope sim --list-scenarios'); default: the storyline")
    p.add_argument("--workers", type=int, default=None, help="override the number of simulated workers")
    p.add_argument("--exporter-port", type=int, default=9400)
    p.add_argument("--prometheus-port", type=int, default=9090)
    p.add_argument("--console-port", type=int, default=8501)
    p.add_argument("--run-dir", type=Path, default=ROOT / ".demo",
                   help="where configs, logs and Prometheus data go (default %(default)s)")
    p.add_argument("--no-prometheus", action="store_true", help="run on the exporter alone")
    p.add_argument("--no-console", action="store_true")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: run until Ctrl-C)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    run = args.run_dir
    if run.exists():
        shutil.rmtree(run)
    (run / "logs").mkdir(parents=True)
    sup = Supervisor(run / "logs")
    stopping = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)

    host = "127.0.0.1"
    exporter_addr = f"{host}:{args.exporter_port}"
    exporter_url = f"http://{exporter_addr}"
    manifest = run / "fleet.json"
    try:
        # 1. the fleet (real time) with the reference router, posting records to the exporter
        sim_cmd = _prefixscope("sim", "--manifest", str(manifest),
                               "--records-url", f"{exporter_url}/api/v1/records")
        sim_cmd += ["--scenario", args.scenario] if args.scenario else ["--storyline"]
        if args.workers:
            sim_cmd += ["--workers", str(args.workers)]
        sim = sup.start("sim", sim_cmd)
        deadline = time.monotonic() + 60
        while not manifest.exists():
            if sim.poll() is not None or time.monotonic() > deadline:
                print(f"the simulated fleet did not start; see {run / 'logs' / 'sim.log'}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        # The manifest is written atomically once every worker serves: endpoints + topology.
        data = json.loads(manifest.read_text())
        topology = data.get("topology")

        # 2. the exporter
        cfg_path = run / "exporter.yaml"
        cfg_path.write_text(yaml.safe_dump(exporter_config(manifest, Path(topology) if topology else None, 5.0)))
        exp = sup.start("exporter", _prefixscope("export", "--config.file", str(cfg_path),
                                                 "--web.listen-address", exporter_addr))
        if not wait_http(f"{exporter_url}/healthz", 30, exp):
            print(f"the exporter did not start; see {run / 'logs' / 'exporter.log'}", file=sys.stderr)
            return 1

        # 3. Prometheus with the generated rules, when it is installed
        prom_url = None
        prometheus = shutil.which("prometheus")
        if args.no_prometheus:
            print("Prometheus: off (--no-prometheus); the console runs on the exporter alone")
        elif prometheus is None:
            print("Prometheus: not installed — the console runs on the exporter alone. "
                  "Install it with: apt-get install prometheus (as root), then run the demo again.")
        else:
            prom_cfg = run / "prometheus.yml"
            prom_cfg.write_text(yaml.safe_dump(prometheus_config(exporter_addr, RULES)))
            prom = sup.start("prometheus", [prometheus, f"--config.file={prom_cfg}",
                                            f"--storage.tsdb.path={run / 'prometheus-data'}",
                                            f"--web.listen-address={host}:{args.prometheus_port}",
                                            "--storage.tsdb.retention.time=6h", "--web.enable-lifecycle"])
            prom_url = f"http://{host}:{args.prometheus_port}"
            if not wait_http(f"{prom_url}/-/ready", 30, prom):
                print(f"Prometheus did not start; see {run / 'logs' / 'prometheus.log'}", file=sys.stderr)
                return 1

        # 4. the console
        console_url = None
        if not args.no_console:
            cmd = _prefixscope("console", "--exporter-url", exporter_url, "--port", str(args.console_port))
            if prom_url:
                cmd += ["--prometheus-url", prom_url]
            con = sup.start("console", cmd)
            console_url = f"http://{host}:{args.console_port}/"
            if not wait_http(f"http://{host}:{args.console_port}/_stcore/health", 60, con):
                print(f"the console did not start; see {run / 'logs' / 'console.log'}", file=sys.stderr)
                return 1

        print("\nprefixscope demo is running:")
        print(f"  console      {console_url or '(off)'}")
        print(f"  exporter     {exporter_url}/  (metrics: {exporter_url}/metrics)")
        print(f"  prometheus   {prom_url or '(not running)'}")
        print(f"  fleet        {len(data['workers'])} simulated workers (manifest {manifest})")
        print(f"  logs         {run / 'logs'}")
        print("Press Ctrl-C to stop.\n", flush=True)

        started = time.monotonic()
        while not stopping:
            dead = sup.dead()
            if dead:
                print(f"stopped: {', '.join(dead)} exited; see {run / 'logs'}", file=sys.stderr)
                return 1
            if args.duration is not None and time.monotonic() - started >= args.duration:
                break
            time.sleep(0.5)
        return 0
    finally:
        sup.stop()
        print("prefixscope demo stopped; every process it started has exited.", flush=True)
