"""``prefixscope sim``: the simulated fleet, its reference router, workloads and fault scenarios.

Real time (the default, and the demo): N workers serve /metrics, KV events and the OpenAI API
on 127.0.0.1; the reference router drives a scenario (or the storyline: every fault in turn)
and sends its request records to ``--records-url`` and/or ``--records-file``. ``--accelerated``
runs the same on a virtual clock without servers and prints each check's raw value before and
after the fault. ``--no-traffic`` only serves the workers (for external routers). In real time the
reference router serves its own /metrics in a real router's names (``--router-metrics``, else the
topology's ``router_metrics``, else sglang), named in the manifest as ``router.metrics_url``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import yaml

from fleet.announce import Announcer
from fleet.control import FleetControl
from fleet.policies import POLICIES
from fleet.records import FileSink, HttpSink, MultiSink, RecordSink
from fleet.router import Router
from fleet.router_http import RouterMetricsServer
from fleet.router_metrics import CHOICES, DEFAULT_FLAVOUR, NONE, RouterMetrics
from fleet.scenarios import Scenario, ScenarioError, load_preset, presets
from fleet.simulation import ScaledClock, SimResult, Simulation, with_block_size, worker_spec
from fleet.storyline import STORYLINES, runs, storyline
from fleet.topology import Topology, TopologyError, load_topology
from fleet.traces import MOONCAKE_BLOCK_SIZE, load_mooncake, replay_requests
from fleet.workers import FleetOptions, WorkerFleet
from prefixscope.units import format_duration


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixscope sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", type=Path, default=None, help="topology file (default: the packaged 8-worker fleet)")
    p.add_argument("--workers", type=int, default=None, help="use the first N workers (or grow the fleet to N)")
    p.add_argument("--policy", choices=POLICIES, default=None, help="routing policy (default: the scenario's)")
    p.add_argument("--scenario", default="healthy", help="a preset name or a scenario file (default: %(default)s)")
    p.add_argument("--storyline", nargs="?", const="full", choices=STORYLINES, default=None,
                   help="run presets in turn: 'full' (every preset, healthy first; the default of a bare "
                        "--storyline) or 'short' (three faults along the chain, eight to eleven minutes each)")
    p.add_argument("--repeat", action="store_true",
                   help="real time: run the scenario (or storyline) again and again until stopped")
    p.add_argument("--trace", type=Path, default=None,
                   help="replay a Mooncake-format trace (JSONL) instead of the scenario's workload (block size 512)")
    p.add_argument("--list-scenarios", action="store_true", help="list the presets and exit")
    p.add_argument("--announce", type=Path, default=None, metavar="FILE",
                   help="append each storyline step, fault and restored worker to FILE (JSON lines) for the console")
    p.add_argument("--records-url", default=None, help="POST request records as NDJSON here (the exporter's /api/v1/records)")
    p.add_argument("--records-token", default=os.environ.get("PREFIXSCOPE_RECORDS_TOKEN"),
                   help="bearer token for --records-url (default: $PREFIXSCOPE_RECORDS_TOKEN)")
    p.add_argument("--records-file", type=Path, default=None, help="append request records (NDJSON) to this file")
    p.add_argument("--metrics-flavour", choices=("vllm", "vllm-legacy", "sglang"), default="vllm")
    p.add_argument("--kv-cache-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="the workers run as vLLM with --kv-cache-metrics: sampled block residency histograms "
                        "(vllm:kv_block_*_seconds, 1%% of blocks) on /metrics, absent with --no-kv-cache-metrics "
                        "(default: on)")
    p.add_argument("--event-encoding", choices=("array", "map"), default="array",
                   help="KV-event encoding: array-tagged (vLLM ≤ 0.23) or maps (≥ 0.24)")
    p.add_argument("--speed", type=float, default=1.0, help="real-time clock multiplier (default: %(default)s)")
    p.add_argument("--accelerated", action="store_true",
                   help="virtual clock, no servers: run as fast as possible and print the signals")
    p.add_argument("--duration", type=float, default=None, help="seconds of simulated time (default: the scenario's)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-traffic", action="store_true", help="only serve the workers (for an external router)")
    p.add_argument("--manifest", type=Path, default=None,
                   help="write the workers' endpoints and the topology here once they serve (JSON)")
    p.add_argument("--control-port", type=int, default=0,
                   help="real time: the control endpoint's port on 127.0.0.1 (kill/restart a worker; "
                        "default: a free port, named in the manifest)")
    p.add_argument("--router-metrics", choices=CHOICES, default=None,
                   help="real time: whose /metrics names the reference router serves (default: the topology's "
                        f"router_metrics, else {DEFAULT_FLAVOUR}; {NONE}: no router /metrics)")
    p.add_argument("--router-port", type=int, default=0,
                   help="real time: the router /metrics port on 127.0.0.1 (default: a free port, named in the manifest)")
    # Kept only to say where these went: the exporter's verdict after a warm-up is `prefixscope steady`.
    p.add_argument("--warmup", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def list_scenarios() -> str:
    rows = [("scenario", "step", "expected alerts", "fault")]
    for sc in presets():
        step = "-" if sc.expected_step is None else str(sc.expected_step)
        rows.append((sc.name, step, ", ".join(sc.expected_alerts) or "none", sc.description))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)


def _sink(args: argparse.Namespace) -> RecordSink | None:
    sinks: list[RecordSink] = []
    if args.records_url:
        sinks.append(HttpSink(args.records_url, token=args.records_token))
    if args.records_file:
        sinks.append(FileSink(args.records_file))
    return MultiSink(sinks) if sinks else None


def write_manifest(path: Path, fleet: WorkerFleet, topology: Topology, control_url: str | None = None,
                   router: dict[str, str] | None = None) -> None:
    """Endpoints plus the effective topology, written atomically (readers poll for the file);
    ``router`` is the reference router's ``metrics_url`` and ``flavour`` when it serves /metrics."""
    topo_path = path.with_name(path.stem + ".topology.yaml")
    topo_path.write_text(yaml.safe_dump(topology.as_dict(), sort_keys=False), encoding="utf-8")
    tmp = path.with_suffix(path.suffix + ".tmp")
    body: dict = {"workers": fleet.endpoints(), "topology": str(topo_path.resolve())}
    if control_url:
        body["control"] = control_url
    if router:
        body["router"] = router
    tmp.write_text(json.dumps(body, indent=2), encoding="utf-8")
    tmp.replace(path)


# What an accelerated run prints after each scenario (``prefixscope sim`` prints each check's recount).
Report = Callable[[SimResult, Scenario], str]


def main(argv: list[str] | None = None, *, cold_share: float | None = None, report: Report | None = None) -> int:
    """Run the fleet. ``cold_share`` is the threshold file's ``cold_reuse_share`` (None: the
    router's default), handed in by whoever composes the run, as is ``report``."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    args.cold_share = cold_share
    if args.list_scenarios:
        print(list_scenarios())
        return 0
    if args.warmup is not None or args.json:
        # the verdict is the exporter's, and the fleet does not import the exporter
        print("prefixscope sim: --warmup/--json read the exporter's verdict: run them as "
              "`prefixscope steady --warmup 2h [--json] ...`", file=sys.stderr)
        return 2
    try:
        topology = load_topology(args.topology)
        if args.workers:
            topology = topology.with_workers(args.workers)
        scenarios = storyline(args.storyline) if args.storyline else [load_preset(args.scenario)]
    except (TopologyError, ScenarioError) as exc:
        print(f"prefixscope sim: {exc}", file=sys.stderr)
        return 2
    if args.trace is not None:
        try:
            trace, errors = load_mooncake(args.trace)
        except OSError as exc:
            print(f"prefixscope sim: {args.trace.name}: cannot read trace: {exc.strerror or exc}", file=sys.stderr)
            return 2
        for e in errors[:5]:
            print(f"prefixscope sim: {args.trace.name}: {e} (skipped)", file=sys.stderr)
        if len(errors) > 5:
            print(f"prefixscope sim: {args.trace.name}: {len(errors) - 5} more bad lines skipped", file=sys.stderr)
        if not trace:
            print(f"prefixscope sim: {args.trace.name}: no valid requests", file=sys.stderr)
            return 2
        topology = with_block_size(topology, MOONCAKE_BLOCK_SIZE)  # the same KV capacity in tokens
        args.requests = trace
        if args.duration is None:
            args.duration = trace[-1].t + 1
    else:
        args.requests = None
    sink = _sink(args)
    try:
        if args.accelerated:
            return _accelerated(args, topology, scenarios, sink, report)
        return _real_time(args, topology, scenarios, sink)
    finally:
        if sink is not None:
            sink.close()


def _accelerated(args: argparse.Namespace, topology: Topology, scenarios: list[Scenario], sink,
                 report: Report | None) -> int:
    for sc in scenarios:
        sim = Simulation(sc, topology, policy=args.policy, sink=sink, duration_s=args.duration, seed=args.seed,
                         requests=replay_requests(args.requests) if args.requests else None,
                         cold_share=args.cold_share, kv_cache_metrics=args.kv_cache_metrics)
        result = sim.run()
        print(f"== {sc.name}: {len(result.records)} requests over {sim.duration_s:g} s simulated "
              f"in {result.wall_s:.2f} s; fault at {sc.fault_at_s:g} s — {sc.fault}")
        if report is not None:
            print(report(result, sc))
    return 0


def _real_time(args: argparse.Namespace, topology: Topology, scenarios: list[Scenario], sink) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    clock = StoppableClock(args.speed, stop)
    specs = [worker_spec(topology, w, kv_cache_metrics=args.kv_cache_metrics) for w in topology.workers]
    options = FleetOptions(flavour=args.metrics_flavour, encoding=args.event_encoding)
    with WorkerFleet(specs, clock=clock, options=options) as fleet:
        control = FleetControl(fleet, port=args.control_port).start()
        router = None if args.no_traffic else RouterFace.start(args, topology, fleet)
        try:
            return _drive(args, topology, scenarios, sink, fleet, control, clock, stop, router)
        finally:
            control.stop()
            if router is not None:
                router.stop()


def router_flavour(requested: str | None, topology: Topology) -> str:
    """Whose /metrics names the reference router serves: the command line's, else the topology's,
    else the demo's default."""
    return requested or topology.router_metrics or DEFAULT_FLAVOUR


class RouterFace:
    """The reference router's /metrics: one tally for the whole run (as one router process
    would keep across the scenarios), rendered by whichever simulation routes now."""

    def __init__(self, flavour: str, fleet: WorkerFleet, policy: str, port: int = 0) -> None:
        self.flavour, self.fleet, self.policy = flavour, fleet, policy
        self.metrics = RouterMetrics(flavour)
        self.server = RouterMetricsServer(self.page, port=port)
        self.router: Router | None = None  # the current simulation's

    @classmethod
    def start(cls, args: argparse.Namespace, topology: Topology, fleet: WorkerFleet) -> RouterFace | None:
        flavour = router_flavour(args.router_metrics, topology)
        if flavour == NONE:
            return None
        face = cls(flavour, fleet, args.policy or "topology-aware", args.router_port)
        face.server.start()
        return face

    def url_of(self, worker: str) -> str:
        return self.fleet[worker].url if worker in self.fleet.workers else worker

    def page(self) -> str:
        router = self.router
        if router is not None:
            return router.metrics_page(self.url_of)
        return self.metrics.render({w.name: w.alive for w in self.fleet}, self.policy, self.url_of)

    @property
    def manifest_entry(self) -> dict[str, str]:
        return {"metrics_url": self.server.metrics_url, "flavour": self.flavour}

    def stop(self) -> None:
        self.server.stop()


class StoppableClock(ScaledClock):
    """Real time whose waits end at once when the fleet is told to stop (a quiet workload may
    otherwise sleep seconds until its next arrival before it sees Ctrl-C)."""

    def __init__(self, speed: float, stop: threading.Event) -> None:
        super().__init__(speed)
        self._stop = stop

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._stop.wait(seconds / self.speed)


def _drive(args: argparse.Namespace, topology: Topology, scenarios: list[Scenario], sink, fleet: WorkerFleet,
           control: FleetControl, clock: StoppableClock, stop: threading.Event, router: RouterFace | None = None) -> int:
    news = Announcer(args.announce)
    for w in fleet:
        news.say(f"{w.name}: {w.url}  kv={w.kv_endpoint}  replay={w.replay_endpoint}", announce=False)
    news.say(f"control: {control.url}/workers (POST /workers/<name>/kill or /restart)", announce=False)
    if router is not None:
        news.say(f"router: {router.server.metrics_url} ({router.flavour} names)", announce=False)
    control.announce = news.say
    published = ManifestPublisher(args.manifest, fleet, topology, control.url,
                                  router.manifest_entry if router is not None else None, news)
    published.refresh()
    if args.no_traffic:
        news.say("serving workers only (--no-traffic); Ctrl-C stops", announce=False)
        while not stop.wait(0.2):
            control.apply(None)
            published.refresh()
        return 0
    for n, (sc, seed) in enumerate(runs(scenarios, args.seed, repeat=args.repeat)):
        if stop.is_set():
            break
        step = f"step {n % len(scenarios) + 1} of {len(scenarios)}" if len(scenarios) > 1 else "scenario"
        news.say(f"{step}: {sc.name} — healthy for {format_duration(sc.fault_at_s)}, then the fault: {sc.fault}")
        sim = Simulation(sc, topology, policy=args.policy, clock=clock, sink=sink,
                         duration_s=args.duration, seed=seed, fleet=fleet, track_placement=False,
                         requests=replay_requests(args.requests) if args.requests else None,
                         router_metrics=router.metrics if router is not None else None,
                         cold_share=args.cold_share)
        if router is not None:
            router.router = sim.router
        told = {"events": 0, "fault": False}

        def between_requests(_record: dict | None, sim: Simulation = sim, sc: Scenario = sc, told: dict = told) -> None:
            control.apply(sim)
            published.refresh()
            if not told["fault"] and sim.clock.now() - sim.start >= sc.fault_at_s:
                told["fault"] = True
                news.say(f"{sc.name}: the fault begins — {sc.fault}")
            for _at, what in sim.events[told["events"]:]:
                news.say(f"{sc.name}: {what}")
            told["events"] = len(sim.events)
        result = sim.run(on_request=between_requests, should_stop=stop.is_set)
        news.say(f"{sc.name}: ended, {len(result.records)} requests routed", announce=False)
        control.apply(None)
        _heal(fleet, news)
        published.refresh()
    return 0


class ManifestPublisher:
    """Writes the manifest once the workers serve, and again when a restart moved a worker to
    fresh ports (its old one was taken), so readers find it at its new address."""

    def __init__(self, path: Path | None, fleet: WorkerFleet, topology: Topology, control_url: str,
                 router: dict[str, str] | None = None, news: Announcer | None = None) -> None:
        self.path, self.fleet, self.topology, self.control_url = path, fleet, topology, control_url
        self.router = router
        self.news = news or Announcer()
        self._moves: int | None = None

    def refresh(self) -> None:
        if self.path is None or self._moves == self.fleet.moves:
            return
        if self._moves is not None:
            self.news.say(f"a worker came back on new ports; manifest {self.path} rewritten", announce=False)
        self._moves = self.fleet.moves
        write_manifest(self.path, self.fleet, self.topology, self.control_url, self.router)


def _heal(fleet: WorkerFleet, news: Announcer | None = None) -> None:
    """Between storyline scenarios: dead workers restart and fault knobs go back to normal. A
    worker that cannot restart stays down (the fleet carries on; the next heal tries again)."""
    news = news or Announcer()
    for w in fleet:
        if not w.alive:
            try:
                fleet.restart(w.name)
            except (OSError, RuntimeError) as exc:
                news.say(f"worker {w.name} could not restart: {exc}")
            else:
                news.say(f"worker {w.name} restored (restarted between scenarios, its cache empty)")
    for w in fleet:
        k = w.engine.knobs
        k.prefill_slowdown, k.expert_misalignment, k.drop_kv_events = 1.0, 0.0, 0.0
        k.affinity_admission, k.healthy = True, True
        k.spec_acceptance = w.spec.spec_acceptance
