"""``prefixscope demo``: the whole product on one machine.

Starts, in order: the simulated fleet with the reference router (real time), the exporter
(reading the fleet's manifest, receiving its request records), Alertmanager with the generated
inhibition rules and Prometheus on 127.0.0.1 with rules generated from the demo's threshold
profile (when Debian's ``prometheus-alertmanager`` and ``prometheus`` are installed; otherwise the
demo runs without them and says so), and the console. It prints the URLs, runs the short
storyline (three faults along the chain, eight to eleven minutes each; ``--storyline full`` for every
preset) over and over, or ``--scenario NAME`` (repeated), and keeps running through faults: a
killed worker is a migration, a stopped Prometheus sends the console to the exporter, an
exporter or console that exits is started again (bounded backoff). Only the fleet exiting ends
the demo. Ctrl-C or SIGTERM stops every process it started.
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
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from alerts import profiles
from fleet.scenarios import ScenarioError, load_preset
from fleet.storyline import STORYLINES
from prefixscope.thresholds import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ALERTMANAGER_CONFIG = ROOT / "alerts" / "generated" / "alertmanager.yaml"
PROMETHEUS_ENV = "PREFIXSCOPE_PROMETHEUS"  # the Prometheus binary (default: `prometheus` on PATH)
ALERTMANAGER_ENV = "PREFIXSCOPE_ALERTMANAGER"  # default: `prometheus-alertmanager` (Debian), else `alertmanager`
NO_PROFILE = "none"  # --profile none: alerts/thresholds.yaml as it is
HOST = "127.0.0.1"

# What the demo does when a child exits.
ESSENTIAL = "essential"  # the demo ends (the fleet: without it there is nothing to observe)
RESTART = "restart"  # started again after a bounded backoff (exporter, console)
OPTIONAL = "optional"  # reported once and left down (Prometheus: the console falls back)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a child that ran this long restarts without delay again


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def choose_port(requested: int, host: str = HOST) -> tuple[int, str | None]:
    """``requested`` if it can be bound, else a free port; 0 asks for a free port. Returns (port, note)."""
    if requested == 0:
        return free_port(host), None
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves bind
        try:
            s.bind((host, requested))
        except OSError:
            port = free_port(host)
            return port, f"port {requested} is in use; using {port}"
    return requested, None


def next_backoff(previous_s: float | None, ran_s: float) -> float:
    """Delay before the next restart: doubling from BACKOFF_FIRST_S up to BACKOFF_MAX_S, reset after a stable run."""
    if previous_s is None or ran_s >= STABLE_AFTER_S:
        return BACKOFF_FIRST_S
    return min(BACKOFF_MAX_S, previous_s * 2)


def exporter_config(manifest: Path, topology: Path | None, scrape_interval: float,
                    thresholds: Path | None = None, router_metrics_url: str | None = None,
                    state_file: Path | None = None) -> dict:
    """The exporter's config for a demo fleet described by its manifest (and its reference
    router's /metrics, scraped as a router of the kind its names show)."""
    cfg: dict = {
        "fleet_manifest": str(manifest),
        "records": {"http": {"enabled": True}},
        "scrape_interval": f"{scrape_interval:g}s",
        "prefix_text": True,  # the simulated prompts are not private: name hot prefixes by their words
    }
    if state_file is not None:  # "what changed" and prefix names outlive an exporter restart
        cfg["state_file"] = str(state_file)
        cfg["state_interval"] = "15s"
    if topology is not None:
        cfg["topology"] = str(topology)
    if thresholds is not None:
        cfg["thresholds"] = str(thresholds)
    if router_metrics_url:
        cfg["routers"] = [{"name": "router", "metrics_url": router_metrics_url, "kind": "auto"}]
    return cfg


def alerting_files(profile: str, run: Path) -> tuple[Path, Path | None]:
    """The rule file Prometheus loads and the thresholds file the exporter reads (None: the
    packaged one). A profile's are generated into the run directory from the catalogue."""
    if profile == NO_PROFILE:
        return ROOT / "alerts" / "generated" / "prefixscope.rules.yaml", None
    rules, thresholds = run / "prefixscope.rules.yaml", run / "thresholds.yaml"
    thresholds.write_text(profiles.thresholds_yaml(profile), encoding="utf-8")
    rules.write_text(profiles.rule_file(profile), encoding="utf-8")
    return rules, thresholds


def prometheus_config(exporter_address: str, rules: Path, interval_s: int = 5,
                      alertmanager_address: str | None = None) -> dict:
    """A Prometheus config scraping the exporter, loading the rules and, when one runs, sending
    its alerts to Alertmanager."""
    cfg: dict = {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "prefixscope", "static_configs": [{"targets": [exporter_address]}]},
        ],
    }
    if alertmanager_address:
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager_address]}]}]}
    return cfg


def _find(what: str, flag: str | None, env: str, names: Sequence[str], package: str) -> tuple[str | None, str]:
    wanted = flag or os.environ.get(env)
    if wanted:
        found = shutil.which(wanted)
        if found is None:
            return None, f"{what}: {wanted} is not an executable"
        return found, ""
    for name in names:
        if (found := shutil.which(name)) is not None:
            return found, ""
    return None, f"{what}: not installed (install it with: apt-get install {package}, as root; then run the demo again)"


def find_prometheus(flag: str | None) -> tuple[str | None, str]:
    """The Prometheus binary to run (flag, then $PREFIXSCOPE_PROMETHEUS, then PATH) and why not, if none."""
    return _find("Prometheus", flag, PROMETHEUS_ENV, ("prometheus",), "prometheus")


def find_alertmanager(flag: str | None) -> tuple[str | None, str]:
    """The Alertmanager binary (flag, then $PREFIXSCOPE_ALERTMANAGER, then PATH) and why not, if none."""
    return _find("Alertmanager", flag, ALERTMANAGER_ENV, ("prometheus-alertmanager", "alertmanager"),
                 "prometheus-alertmanager")


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
              stop: threading.Event | None = None) -> bool:
    """Poll ``url`` until it answers 2xx; give up early when ``proc`` has exited or ``stop`` is set."""
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
        if stop is not None and stop.wait(0.25):
            return False
        if stop is None:
            time.sleep(0.25)
    return False


@dataclass
class Child:
    name: str
    cmd: list[str]
    policy: str
    proc: subprocess.Popen
    started_at: float
    backoff_s: float | None = None
    restart_at: float | None = None  # set while a restart is pending
    reported: bool = False  # the exit was seen (and its process group cleaned up)
    gone_note: str = ""  # OPTIONAL: what its exit means for the rest of the demo


@dataclass
class Supervisor:
    """Starts children in their own process groups, restarts or reports them, and stops all of them."""

    logs: Path
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    children: dict[str, Child] = field(default_factory=dict)

    def _spawn(self, name: str, cmd: Sequence[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=ROOT)

    def start(self, name: str, cmd: Sequence[str], policy: str = RESTART, gone_note: str = "") -> subprocess.Popen:
        proc = self._spawn(name, cmd)
        self.children[name] = Child(name, list(cmd), policy, proc, self.clock(), gone_note=gone_note)
        return proc

    def restart_now(self, name: str, grace_s: float = 5.0) -> None:
        """Stop a RESTART child and start it again at once (it must read changed inputs)."""
        c = self.children[name]
        if c.proc.poll() is None:
            self._stop_all([c.proc], grace_s)
        c.proc = self._spawn(c.name, c.cmd)
        c.started_at, c.restart_at, c.reported = self.clock(), None, False

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children.values() if c.proc.poll() is None}

    def check(self) -> str | None:
        """One supervision round; returns the name of an ESSENTIAL child that exited, else None."""
        now = self.clock()
        for c in self.children.values():
            code = c.proc.poll()
            if code is None:
                continue
            if not c.reported:
                c.reported = True
                _kill_group(c.proc.pid, signal.SIGKILL)  # whatever the exited leader left behind
                if c.policy == OPTIONAL:
                    self.say(f"{c.name} stopped (exit code {code}){'; ' + c.gone_note if c.gone_note else ''}")
            if c.policy == ESSENTIAL:
                return c.name
            if c.policy == OPTIONAL:
                continue
            if c.restart_at is None:
                c.backoff_s = next_backoff(c.backoff_s, now - c.started_at)
                c.restart_at = now + c.backoff_s
                self.say(f"{c.name} exited (exit code {code}); starting it again in {c.backoff_s:g} s")
            elif now >= c.restart_at:
                c.proc = self._spawn(c.name, c.cmd)
                c.started_at, c.restart_at, c.reported = now, None, False
                self.say(f"{c.name} started again (pid {c.proc.pid})")
        return None

    def exit_code(self, name: str) -> int | None:
        return self.children[name].proc.poll()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every running child: the fleet first, so its last records still reach the exporter,
        then the others together; SIGTERM to each process group, SIGKILL what outlives ``grace_s``."""
        # Only groups whose leader we have not reaped yet: a reaped pid may belong to someone else by now.
        running = [c for c in reversed(list(self.children.values())) if c.proc.poll() is None]
        self._stop_all([c.proc for c in running if c.policy == ESSENTIAL], grace_s)
        self._stop_all([c.proc for c in running if c.policy != ESSENTIAL], grace_s)

    @staticmethod
    def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
        for p in procs:
            _kill_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(p.pid, signal.SIGKILL)
                p.wait()
            _kill_group(p.pid, signal.SIGKILL)  # anything the leader left behind in its group


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _prefixscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixscope", *args]


def _port_arg(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0–65535 (0: a free one), got {port}")
    return port


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} above 0, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} above 0, got {text}")
        return value
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The demo's flags, all checked here: a bad one stops the demo (exit 2) before anything starts."""
    p = argparse.ArgumentParser(prog="prefixscope demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default=None,
                   help="run one fault scenario, repeated (see 'prefixscope sim --list-scenarios'); default: the storyline")
    p.add_argument("--storyline", choices=STORYLINES, default="short",
                   help="without --scenario: 'short' (three faults, 29 minutes a pass) or 'full' (every preset, "
                        "~2.5 hours a pass); default %(default)s")
    p.add_argument("--profile", default="demo",
                   help=f"threshold profile of alerts/profiles/ the rules and the exporter use ('{NO_PROFILE}': "
                        "alerts/thresholds.yaml as it is); default %(default)s")
    p.add_argument("--workers", type=_positive(int), default=None, help="override the number of simulated workers")
    p.add_argument("--exporter-port", type=_port_arg, default=9400,
                   help="0 picks a free port; a busy port is replaced by a free one")
    p.add_argument("--prometheus-port", type=_port_arg, default=9090)
    p.add_argument("--alertmanager-port", type=_port_arg, default=9093)
    p.add_argument("--console-port", type=_port_arg, default=8501)
    p.add_argument("--run-dir", type=Path, default=ROOT / ".demo",
                   help="where configs, logs and Prometheus data go (default %(default)s)")
    p.add_argument("--prometheus-bin", default=None,
                   help=f"the Prometheus binary (default ${PROMETHEUS_ENV}, else 'prometheus' on PATH)")
    p.add_argument("--alertmanager-bin", default=None,
                   help=f"the Alertmanager binary (default ${ALERTMANAGER_ENV}, else 'prometheus-alertmanager' on PATH)")
    p.add_argument("--no-prometheus", action="store_true", help="run on the exporter alone")
    p.add_argument("--no-alertmanager", action="store_true", help="Prometheus evaluates the rules but pages nobody")
    p.add_argument("--no-console", action="store_true")
    p.add_argument("--kill-worker-after", type=_positive(float), default=None, metavar="SECONDS",
                   help="kill the first worker this long after the demo is up (it restarts when the scenario ends)")
    p.add_argument("--duration", type=_positive(float), default=None,
                   help="stop after this many seconds (default: run until Ctrl-C)")
    args = p.parse_args(argv)
    if args.scenario is not None:
        try:
            load_preset(args.scenario)
        except ScenarioError as exc:
            p.error(f"--scenario: {exc}")
    if args.profile != NO_PROFILE:
        try:
            profiles.load(args.profile)
        except ConfigError as exc:
            p.error(f"--profile: {exc}")
    return args


def post(url: str, timeout_s: float = 15.0) -> str:
    """POST without a body; the answer's text, or the error."""
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.read().decode(errors="replace")
    except OSError as exc:
        return str(exc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    run = args.run_dir
    if run.exists():
        shutil.rmtree(run)
    (run / "logs").mkdir(parents=True)

    def say(line: str) -> None:
        print(line, flush=True)

    sup = Supervisor(run / "logs", say=say)
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        return _run(args, run, sup, stop, say)
    finally:
        sup.stop()
        say("prefixscope demo stopped; every process it started has exited.")


def _port(requested: int, what: str, say: Callable[[str], None]) -> int:
    port, note = choose_port(requested)
    if note:
        say(f"{what}: {note}")
    return port


def _launch(sup: Supervisor, name: str, cmd: Sequence[str], policy: str, ready_url: str, timeout_s: float,
            stop: threading.Event, say: Callable[[str], None]) -> int | None:
    """Start a child and wait until ``ready_url`` answers: None when ready, else the demo's exit code."""
    proc = sup.start(name, cmd, policy)
    if wait_http(ready_url, timeout_s, proc, stop):
        return None
    if stop.is_set():
        return 0
    say(f"{name} did not start; see {sup.logs / (name + '.log')}")
    return 1


def _run(args: argparse.Namespace, run: Path, sup: Supervisor, stop: threading.Event,
         say: Callable[[str], None]) -> int:
    logs = run / "logs"
    rules, thresholds = alerting_files(args.profile, run)
    exporter_addr = f"{HOST}:{_port(args.exporter_port, 'exporter', say)}"
    exporter_url = f"http://{exporter_addr}"
    manifest = run / "fleet.json"

    # 1. the fleet (real time) with the reference router, posting records to the exporter; it
    # repeats its scenario(s) so the demo only ends when asked to
    news = run / "announcements.jsonl"  # each storyline step and restored worker, for the console's banner
    sim_cmd = _prefixscope("sim", "--manifest", str(manifest), "--repeat", "--announce", str(news),
                           "--records-url", f"{exporter_url}/api/v1/records")
    sim_cmd += ["--scenario", args.scenario] if args.scenario else ["--storyline", args.storyline]
    if args.workers:
        sim_cmd += ["--workers", str(args.workers)]
    sim = sup.start("sim", sim_cmd, ESSENTIAL)
    deadline = time.monotonic() + 60
    while not manifest.exists():  # written atomically once every worker serves
        if sim.poll() is not None or time.monotonic() > deadline:
            say(f"the simulated fleet did not start; see {logs / 'sim.log'}")
            return 1
        if stop.wait(0.2):
            return 0
    manifest_text = manifest.read_text()
    data = json.loads(manifest_text)
    topology = data.get("topology")
    control = data.get("control")
    router_metrics_url = (data.get("router") or {}).get("metrics_url")

    # 2. the exporter: restarted if it exits; a new one replays every worker's KV events from seq 0
    cfg_path = run / "exporter.yaml"
    cfg_path.write_text(yaml.safe_dump(exporter_config(manifest, Path(topology) if topology else None, 5.0,
                                                       thresholds, router_metrics_url, run / "exporter-state.json")))
    exp_cmd = _prefixscope("export", "--config.file", str(cfg_path), "--web.listen-address", exporter_addr)
    if (code := _launch(sup, "exporter", exp_cmd, RESTART, f"{exporter_url}/healthz", 30, stop, say)) is not None:
        return code

    # 3. Alertmanager with the generated inhibition rules (an incident pages once, at its first
    # failing step) and Prometheus with the profile's rules, when they are installed; if one
    # stops, it is reported and left down (the console falls back to the exporter)
    prom_url = am_url = None
    prometheus, missing = find_prometheus(args.prometheus_bin)
    if args.no_prometheus:
        say("Prometheus: off (--no-prometheus); the console runs on the exporter alone")
    elif prometheus is None:
        say(f"{missing} — the console runs on the exporter alone.")
    else:
        alertmanager, am_missing = find_alertmanager(args.alertmanager_bin)
        if args.no_alertmanager:
            say("Alertmanager: off (--no-alertmanager); Prometheus's alerts page nobody")
        elif alertmanager is None:
            say(f"{am_missing} — Prometheus's alerts page nobody.")
        else:
            am_port = _port(args.alertmanager_port, "Alertmanager", say)
            am_cmd = [alertmanager, f"--config.file={ALERTMANAGER_CONFIG}",
                      f"--storage.path={run / 'alertmanager-data'}", f"--web.listen-address={HOST}:{am_port}",
                      "--cluster.listen-address="]  # one instance: no gossip port
            am_url = f"http://{HOST}:{am_port}"
            proc = sup.start("alertmanager", am_cmd, OPTIONAL, gone_note="Prometheus's alerts page nobody")
            if not wait_http(f"{am_url}/-/ready", 30, proc, stop):
                if stop.is_set():
                    return 0
                say(f"Alertmanager did not start (see {logs / 'alertmanager.log'}); Prometheus's alerts page nobody")
                am_url = None
        prom_port = _port(args.prometheus_port, "Prometheus", say)
        prom_cfg = run / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump(prometheus_config(exporter_addr, rules,
                                                             alertmanager_address=am_url and am_url.removeprefix("http://"))))
        prom_cmd = [prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={run / 'prometheus-data'}",
                    f"--web.listen-address={HOST}:{prom_port}", "--storage.tsdb.retention.time=6h",
                    "--web.enable-lifecycle"]
        prom_url = f"http://{HOST}:{prom_port}"
        proc = sup.start("prometheus", prom_cmd, OPTIONAL, gone_note="the console falls back to the exporter alone")
        if not wait_http(f"{prom_url}/-/ready", 30, proc, stop):
            if stop.is_set():
                return 0
            say(f"prometheus did not start; see {logs / 'prometheus.log'}")
            return 1

    # 4. the console
    console_url = None
    if not args.no_console:
        console_port = _port(args.console_port, "console", say)
        cmd = _prefixscope("console", "--exporter-url", exporter_url, "--port", str(console_port),
                           "--announcements", str(news))
        if prom_url:
            cmd += ["--prometheus-url", prom_url]
        if am_url:
            cmd += ["--alertmanager-url", am_url]
        console_url = f"http://{HOST}:{console_port}/"
        if (code := _launch(sup, "console", cmd, RESTART, f"{console_url}_stcore/health", 60, stop, say)) is not None:
            return code

    first = data["workers"][0]["name"]
    say("\nprefixscope demo is running:")
    say(f"  console      {console_url or '(off)'}")
    say(f"  exporter     {exporter_url}/  (metrics: {exporter_url}/metrics)")
    say(f"  prometheus   {prom_url + '  (its alerts: ' + prom_url + '/classic/alerts)' if prom_url else '(not running)'}")
    # Debian's Alertmanager has no web page of its own: its alerts, silences and inhibitions are
    # on the console's Alerts page, which reads its API.
    alerts_page = f"{console_url}alerts" if console_url else f"{am_url}/api/v2/alerts"
    say(f"  alertmanager {am_url + '  (alerts, silences, inhibitions: ' + alerts_page + ')' if am_url else '(not running)'}")
    what = f"scenario {args.scenario}, repeated" if args.scenario else f"the {args.storyline} storyline, repeated"
    say(f"  running      {what}; thresholds: "
        f"{'alerts/thresholds.yaml' if args.profile == NO_PROFILE else 'profile ' + args.profile}")
    say(f"  fleet        {len(data['workers'])} simulated workers (manifest {manifest})")
    if router_metrics_url:
        say(f"  router       {router_metrics_url}  ({data['router'].get('flavour')} names)")
    if control:
        say(f"  control      {control}/workers  (kill a worker: curl -X POST {control}/workers/{first}/kill)")
    say(f"  logs         {logs}  (storyline steps, timestamped: {logs / 'sim.log'})")
    say(f"  pids         {' '.join(f'{n}={p}' for n, p in sup.pids().items())}")
    say("Press Ctrl-C to stop.\n")

    started = time.monotonic()
    kill_at = None if args.kill_worker_after is None else started + args.kill_worker_after
    while not stop.wait(0.25):
        dead = sup.check()
        if dead is not None:
            say(f"the simulated fleet exited (exit code {sup.exit_code(dead)}); the demo stops. "
                f"See {logs / (dead + '.log')}")
            return 1
        if _manifest_changed(manifest, manifest_text):
            manifest_text = manifest.read_text()
            say("a worker came back on new ports; starting the exporter again to read the new manifest")
            sup.restart_now("exporter")
        if kill_at is not None and time.monotonic() >= kill_at:
            kill_at = None
            if control:
                say(f"killing worker {first}: {post(f'{control}/workers/{first}/kill')}")
            else:
                say("cannot kill a worker: the fleet has no control endpoint")
        if args.duration is not None and time.monotonic() - started >= args.duration:
            break
    return 0


def _manifest_changed(manifest: Path, known: str) -> bool:
    try:
        return manifest.read_text() != known
    except OSError:  # being replaced this instant: look again next round
        return False
