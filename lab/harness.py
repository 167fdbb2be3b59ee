"""Replay a scenario through the exporter on the virtual clock, keeping what Prometheus would scrape.

:func:`run_through_exporter` runs a :class:`~fleet.simulation.Simulation` and, on the way, feeds a real
:class:`~exporter.core.state.ClusterState` through the exporter's own adapters, exactly as the live
exporter is fed:

- KV-cache events are encoded in vLLM's wire format (``encode_batch``), numbered per worker as
  a publisher numbers them, and handed as three frames to the real subscriber's
  ``handle_message`` (sequence checks, decode, apply). A batch lost to the ``drop_kv_events``
  knob keeps its sequence number and never arrives, so the subscriber sees the gap; there is
  no replay socket, so the loss stays (the stale-index fault). A dead worker publishes nothing;
  when it comes back it numbers its batches from 0 again, as a restarted vLLM process does.
  Batches published while the fleet starts (pre-warmed system prompts) reach the exporter too:
  it runs from the start.
- Worker /metrics pages are rendered (``render_metrics``) and scraped by the real
  :class:`~exporter.sources.scrape.Scraper` every ``scrape_every_s``; a failed worker's scrape
  fails (``up`` = 0, a ``connect`` ingest error).
- Which workers the exporter follows comes from service discovery, as in production: the
  harness writes the workers the fleet lists (:attr:`fleet.simulation.Simulation.listed`: the
  pool, less those scaled in or restarting) to a ``file_sd`` file whenever that changes, and the
  exporter's own discovery (``exporter.sources.discovery``, relabelling included) reads it and
  its :class:`~exporter.follow.FleetFollower` applies it — scrape targets, KV-event endpoints,
  the state's membership. A worker's batches published while it is not followed (a standby
  worker pre-warmed before it joins, a restarted one before it is listed again) are handed over
  when it is, as the KV-event replay a new endpoint is asked for would; those of a worker that
  was followed, left and comes back without restarting are not (the simulated fleet stops a
  worker it scales in).
- Request records are serialised to NDJSON and go through the record intake's parser and
  ``deliver`` about once a second, as a gateway pushes them.

After every scrape of the workers the exporter's own /metrics is rendered by the real
collector and parsed back; :class:`ScrapeHistory` keeps each series with the simulated scrape
time. That history is what Prometheus would have stored: :meth:`ScrapeHistory.openmetrics`
writes it for ``promtool tsdb create-blocks-from openmetrics`` (backfill), and
:meth:`ScrapeHistory.input_series` writes it as ``promtool test rules`` input.

The clock starts at ``start`` (default 0, the time base of ``promtool test rules``, whose
``time()`` must agree with ``prefixscope_kv_event_last_timestamp_seconds``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, generate_latest

from exporter.bootstrap import bootstrap
from exporter.codecs import promtext
from exporter.config import parse_config
from exporter.core.checks import Evaluation, evaluate
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.follow import FleetFollower
from exporter.sources.discovery.manager import Discovery
from exporter.sources.kv_zmq import KvEventSubscriber
from exporter.sources.records import deliver, parse_lines
from exporter.sources.scrape import ScrapeFailed, Scraper
from exporter.web import api
from exporter.web.collector import PrefixscopeCollector
from fleet.clock import VirtualClock
from fleet.kv_publisher import encode_batch
from fleet.metrics_text import render_metrics
from fleet.scenarios import Scenario
from fleet.simulation import SimResult, Simulation
from fleet.topology import Topology
from prefixscope import catalog
from prefixscope.durations import parse_duration
from prefixscope.thresholds import Thresholds, load_thresholds, window_seconds

SCRAPE_EVERY_S = 15.0  # Prometheus's usual scrape interval
RECORD_FLUSH_S = 1.0  # how often the simulated gateway pushes its buffered records
SIM_DOMAIN = ".fleet.sim"  # host of a simulated worker's /metrics: rendered in-process, not fetched
SD_PROVIDER = "fleet"  # the file_sd provider's name (prefixscope_discovery_targets{provider})


def series_key(name: str, labels: dict[str, str]) -> str:
    """A series in PromQL selector notation, labels sorted: ``name{a="x",b="y"}``."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


@dataclass
class ScrapeHistory:
    """The exporter's /metrics at each scrape: one value (or None: absent) per scrape time."""

    interval_s: float
    times: list[float] = field(default_factory=list)  # seconds since the start of the run
    series: dict[str, list[float | None]] = field(default_factory=dict)

    def add(self, t: float, samples: dict[str, float]) -> None:
        i = len(self.times)
        self.times.append(t)
        for key, value in samples.items():
            col = self.series.get(key)
            if col is None:
                col = self.series[key] = [None] * i
            col.append(value)
        for col in self.series.values():
            if len(col) == i:
                col.append(None)

    def input_series(self) -> list[dict[str, str]]:
        """``promtool test rules`` input: ``_`` before a series exists, ``stale`` when it goes away.

        Sample ``i`` is at ``i × interval``: the scrapes must be evenly spaced from 0.
        """
        for i, t in enumerate(self.times):
            if not math.isclose(t, i * self.interval_s, abs_tol=1e-6):
                raise ValueError(f"scrape {i} at {t}s is not at {i} × {self.interval_s}s")
        out = []
        for key in sorted(self.series):
            parts: list[str] = []
            seen = False
            prev: float | None = None
            for v in self.series[key]:
                if v is None:
                    parts.append("stale" if seen and prev is not None else "_")
                else:
                    parts.append(_number(v))
                    seen = True
                prev = v
            out.append({"series": key, "values": " ".join(parts)})
        return out

    def openmetrics(self, start: float = 0.0) -> str:
        """OpenMetrics text for ``promtool tsdb create-blocks-from openmetrics``, samples at ``start + t``.

        Every series is written untyped, under its sample name, so the stored names are the
        ones PromQL queries (``..._total``, ``..._bucket``).
        """
        lines: list[str] = []
        for key in sorted(self.series):
            for t, v in zip(self.times, self.series[key], strict=True):
                if v is not None:
                    lines.append(f"{key} {_number(v)} {start + t:.3f}")
        lines.append("# EOF")
        return "\n".join(lines) + "\n"


def exporter_samples(state: ClusterState, health: Health) -> dict[str, float]:
    """The exporter's /metrics as the real collector renders it, parsed back into series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PrefixscopeCollector(state, health))
    parsed = promtext.parse(generate_latest(registry).decode())
    if parsed.errors:  # the exporter's own page must always parse
        raise ValueError(f"the exporter rendered malformed lines: {parsed.errors[:3]}")
    out: dict[str, float] = {}
    for name, samples in parsed.samples.items():
        if name.endswith("_created"):
            continue  # prometheus_client's creation timestamps: not scraped into rules
        for s in samples:
            out[series_key(name, s.labels)] = s.value
    return out


class _SimScraper(Scraper):
    """The exporter's scraper with the HTTP fetch replaced by rendering the simulated engine."""

    def __init__(self, fetch: Callable[[str], str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._render = fetch

    def _fetch(self, url: str) -> str:
        return self._render(url)


class _SimSubscriber(KvEventSubscriber):
    """The exporter's KV-event subscriber without sockets: the harness hands it each message, and
    applies the endpoint changes discovery asks for at once (it runs no thread of its own)."""

    def _subscribe(self, worker: str, ep: Any) -> None:
        pass

    def _unsubscribe(self, worker: str) -> None:
        pass

    def follow_now(self) -> None:
        self._apply_changes()

    def handle_message(self, worker: str, frames: list[bytes], received_at: float) -> None:
        """One message, then its worker's queue is empty (the harness hands each message as it is
        published), as a live subscriber finds after reading a backlog (exporter.sources.kv_zmq)."""
        super().handle_message(worker, frames, received_at)
        if worker in self._behind:
            self._caught_up(worker, drained=True)


def sd_target(worker: str) -> dict[str, Any]:
    """A simulated worker as a ``file_sd`` target group: its metrics address and KV-event endpoint,
    named by a label the discovery config relabels into ``worker``."""
    return {"targets": [f"{worker}{SIM_DOMAIN}:8000"],
            "labels": {"__meta_sim_worker": worker, "kv_events": f"inproc://{worker}"}}


# Relabelling as a deployment would write it: keep the fleet's pods, name each worker by its label.
SD_RELABEL = [
    {"source_labels": ["__address__"], "regex": rf".*{SIM_DOMAIN.replace('.', '[.]')}:\d+", "action": "keep"},
    {"source_labels": ["__meta_sim_worker"], "target_label": "worker"},
]


@dataclass
class ScenarioRun:
    """A finished run: the simulation's result, the exporter state it fed, and the scrape history."""

    scenario: Scenario
    result: SimResult
    state: ClusterState
    health: Health
    history: ScrapeHistory
    clock: VirtualClock
    start: float
    kv_batches_sent: dict[str, int]
    kv_batches_lost: dict[str, int]
    # per worker, every batch its publisher numbered: (seq, delivered); seq restarts at 0 after a restart
    kv_timeline: dict[str, list[tuple[int, bool]]]
    # seconds since the start -> (check evaluation, /api/v1/groups) taken right after that scrape
    checkpoints: dict[float, tuple[Evaluation, dict[str, Any]]] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.history.times[-1] if self.history.times else 0.0

    def evaluation(self) -> Evaluation:
        """The exporter's own check evaluation (and verdict) at the end of the run."""
        return evaluate(self.state, now=self.clock.now())


class _Feed:
    """Connects one simulation to one exporter state through the exporter's adapters."""

    def __init__(self, sim: Simulation, state: ClusterState, health: Health, clock: VirtualClock,
                 flavour: str, start: float, scrape_every_s: float, keep_history: bool = True) -> None:
        self.sim, self.state, self.health, self.clock = sim, state, health, clock
        self.flavour, self.start = flavour, start
        self.keep_history = keep_history
        self.history = ScrapeHistory(scrape_every_s)
        self.checkpoint_at: set[float] = set()
        self.checkpoints: dict[float, tuple[Evaluation, dict[str, Any]]] = {}
        self.seq: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.lost: dict[str, int] = {}
        self.timeline: dict[str, list[tuple[int, bool]]] = {}
        self.dead: set[str] = set()
        self.pending: list[bytes] = []
        self.pending_since: float | None = None
        # batches of workers not followed (yet), since their process started: handed over on joining
        self.unfollowed: dict[str, list[list[bytes]]] = {}
        # The subscriber and the scraper start with no worker: discovery gives them theirs.
        self.subscriber = _SimSubscriber({}, state, health, clock=clock.now)
        self.scraper = _SimScraper(self._render, [], state, health, clock=clock.now, max_workers=1)
        self.sd_dir = Path(tempfile.mkdtemp(prefix="prefixscope-sd-"))
        self.sd_file = self.sd_dir / "workers.json"
        self.cfg = parse_config({"discovery": {"file_sd": [{"name": SD_PROVIDER, "files": [str(self.sd_file)],
                                                            "relabel_configs": SD_RELABEL}]}}, "<harness>")
        self.follower = FleetFollower(self.cfg, (), state, health, self.scraper, self.subscriber, clock=clock.now)
        self.discovery = Discovery(self.cfg.discovery, (), self.follower.apply, health, clock=clock.now)
        self.sd_refreshed_at = clock.now()
        self.follow(sim.listed)

    # ---- service discovery ----------------------------------------------------------------------
    def _refresh_discovery(self, listed: Sequence[str]) -> None:
        """Write the discovery file (again: a forked run that finished before this one removed its
        directory), then let the exporter's discovery read it."""
        self.sd_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.sd_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([sd_target(w) for w in listed]), encoding="utf-8")
        os.replace(tmp, self.sd_file)
        self.discovery.refresh_once(force=True)
        self.sd_refreshed_at = self.clock.now()

    def follow(self, listed: Sequence[str]) -> None:
        """The fleet lists ``listed`` now: the exporter's discovery reads it from the file."""
        self._refresh_discovery(listed)
        self.subscriber.follow_now()
        now = self.clock.now()
        for worker in list(self.unfollowed):
            if worker in self.subscriber.endpoints:  # what a replay would fetch now
                for frames in self.unfollowed.pop(worker):
                    self.subscriber.handle_message(worker, frames, now)

    # ---- KV events --------------------------------------------------------------------------
    def on_kv_events(self, worker: str, events: list, ts: float, routed: bool = False) -> None:
        """One engine batch: the router sees (or loses) it first, then the exporter's subscriber."""
        engine = self.sim.engines.get(worker)
        router = self.sim.router
        lost_before = router.kv_events_dropped.get(worker, 0)
        if not routed:
            router.on_kv_events(worker, events, ts)
        if engine is not None and not engine.knobs.healthy:
            self.dead.add(worker)  # a dead process publishes nothing (not even its restart's clear)
            return
        if worker in self.dead:
            self.dead.discard(worker)
            self.seq[worker] = 0  # a restarted vLLM process numbers its batches from 0 again
            self.unfollowed.pop(worker, None)  # what its last process published is gone with it
        seq = self.seq.get(worker, 0)
        self.seq[worker] = seq + 1
        self.sent[worker] = self.sent.get(worker, 0) + 1
        delivered = router.kv_events_dropped.get(worker, 0) == lost_before
        self.timeline.setdefault(worker, []).append((seq, delivered))
        if not delivered:
            self.lost[worker] = self.lost.get(worker, 0) + 1
            return  # numbered by the publisher, never delivered
        frames = [b"", seq.to_bytes(8, "big"), encode_batch(events, ts)]
        if worker not in self.subscriber.endpoints:  # not followed (yet): its replay buffer keeps it
            self.unfollowed.setdefault(worker, []).append(frames)
            return
        self.subscriber.handle_message(worker, frames, max(ts, self.clock.now()))

    # ---- records ------------------------------------------------------------------------------
    def on_request(self, record: dict | None) -> None:
        now = self.clock.now()
        if record is not None:
            self.pending.append(json.dumps(record, separators=(",", ":")).encode())
            if self.pending_since is None:
                self.pending_since = now
        if self.pending_since is not None and now - self.pending_since >= RECORD_FLUSH_S:
            self.flush_records()

    def flush_records(self) -> None:
        if not self.pending:
            return
        now = self.clock.now()
        records, errors = parse_lines(self.pending, now=now)
        deliver(records, errors, self.state, self.health, "http", now)
        self.pending, self.pending_since = [], None

    # ---- scrapes ------------------------------------------------------------------------------
    def _render(self, url: str) -> str:
        worker = (urlsplit(url).hostname or "").removesuffix(SIM_DOMAIN)
        engine = self.sim.engines[worker]
        if not engine.knobs.healthy:
            raise ScrapeFailed("connect", "connection refused (worker is down)")
        return render_metrics(engine, self.flavour).decode()

    def scrape(self) -> None:
        # file_sd reads its file every refresh_interval besides on a change (the virtual clock's)
        if self.clock.now() - self.sd_refreshed_at >= self.cfg.discovery[0].refresh_interval:
            self._refresh_discovery(self.sim.listed)
        self.flush_records()
        self.scraper.scrape_once()  # one scrape thread: targets in order, the run stays deterministic
        t = round(self.clock.now() - self.start, 6)
        if self.keep_history:
            # the live exporter refreshes its tree statistics in the background; /metrics reads the latest
            self.state.refresh_tree_stats()
            self.history.add(t, exporter_samples(self.state, self.health))
        if t in self.checkpoint_at:
            if not self.keep_history:  # nothing read the tree since the last checkpoint: one pass will do
                self.state.refresh_tree_stats()
            self.checkpoints[t] = (evaluate(self.state, now=self.clock.now()), api.groups(self.state))

    def close(self) -> None:
        self.scraper.close()
        self.subscriber.close()
        shutil.rmtree(self.sd_dir, ignore_errors=True)


class _ScrapingSimulation(Simulation):
    """The simulation, its engines' KV events teed to the exporter, its scrape right after each sample."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.feed: _Feed | None = None
        # Batches published while the fleet starts (pre-warmed system prompts), before the feed
        # exists: the exporter runs from the start, so they are handed over when it attaches.
        self._early: list[tuple[str, list, float]] = []
        super().__init__(*args, **kwargs)

    def attach(self, feed: _Feed) -> None:
        self.feed = feed
        for worker, events, ts in self._early:
            feed.on_kv_events(worker, events, ts, routed=True)
        self._early.clear()

    def _events_for(self, worker: str) -> Callable[[list, float], None]:
        route = super()._events_for(worker)

        def cb(events: list, ts: float) -> None:
            if self.feed is not None:
                self.feed.on_kv_events(worker, events, ts)
            else:
                route(events, ts)
                self._early.append((worker, events, ts))
        return cb

    def _sample(self) -> None:
        super()._sample()
        if self.feed is not None:
            self.feed.scrape()

    def _listing_changed(self) -> None:
        if self.feed is not None:
            self.feed.follow(self.listed)


def duration_seconds(text: str) -> float:
    """A Prometheus duration (``5m``, ``1h30m``, ``0m``) in seconds."""
    return parse_duration(text)


def settled_duration(scenario: Scenario, thresholds: Thresholds, scrape_every_s: float = SCRAPE_EVERY_S) -> float:
    """How long to run so that every expected alert has had time to fire.

    An alert needs its rate window filled with the fault, then its ``for`` to elapse, then one
    rule evaluation: fault + window + ``for`` + two scrapes. A healthy scenario runs as long as
    the slowest cause alert would need, so that "nothing fires" covers the same span.
    """
    alerts = scenario.expected_alerts or tuple(c.alert for c in catalog.CHECKS if c.kind != "slo")
    longest = max(duration_seconds(thresholds.checks[catalog.CHECKS_BY_ALERT[a].threshold].for_) for a in alerts)
    need = scenario.fault_at_s + window_seconds(thresholds) + longest + 2 * scrape_every_s
    return max(scenario.duration_s, math.ceil(need / scrape_every_s) * scrape_every_s)


def run_through_exporter(scenario: Scenario, topology: Topology, *, start: float = 0.0, scrape_every_s: float = SCRAPE_EVERY_S,
           flavour: str = "vllm", thresholds_path: str | Path | None = None,
           duration_s: float | None = None, seed: int | None = None,
           checkpoints: Iterable[float] = (), keep_history: bool = True) -> ScenarioRun:
    """Run ``scenario`` on a virtual clock through the exporter; see the module docstring.

    At each of ``checkpoints`` (seconds since the start, on the scrape grid) the exporter's check
    evaluation and its /api/v1/groups payload are kept, as they read at that moment.
    ``keep_history=False`` (hours-long runs read only at checkpoints) renders no /metrics page and
    runs the tree-statistics pass only at checkpoints: the history stays empty, and the
    evaluations are the same (they read only the latest pass).
    """
    replay = Replay(scenario, topology, start=start, scrape_every_s=scrape_every_s, flavour=flavour,
                    thresholds_path=thresholds_path, duration_s=duration_s, seed=seed, checkpoints=checkpoints,
                    keep_history=keep_history)
    return replay.finish()


class Replay:
    """One simulation feeding one exporter state (:func:`run_through_exporter` in steps).

    :meth:`pause_before` runs it up to a moment; :meth:`continue_as` lets another scenario that
    shares everything up to there take over (see ``lab.family``); :meth:`finish` runs to the end.
    """

    def __init__(self, scenario: Scenario, topology: Topology, *, start: float = 0.0,
                 scrape_every_s: float = SCRAPE_EVERY_S, flavour: str = "vllm",
                 thresholds_path: str | Path | None = None, duration_s: float | None = None,
                 seed: int | None = None, checkpoints: Iterable[float] = (), keep_history: bool = True) -> None:
        self.clock = clock = VirtualClock(start)
        self.start = start
        thresholds = load_thresholds(thresholds_path)
        parts = bootstrap(thresholds=thresholds, topology=topology, clock=clock.now)
        self.health, self.state = parts.health, parts.state
        # one threshold file for both sides: the router and the exporter call the same requests cold
        self.sim = _ScrapingSimulation(scenario, topology, clock=clock, duration_s=duration_s, seed=seed,
                                       sample_every_s=scrape_every_s, cold_share=thresholds.cold_reuse_share)
        self.feed = _Feed(self.sim, self.state, self.health, clock, flavour, start, scrape_every_s, keep_history)
        self.feed.checkpoint_at = {round(float(t), 6) for t in checkpoints}
        self.sim.attach(self.feed)

    def pause_before(self, t: float) -> None:
        """Everything before ``t`` seconds since the start has run (requests, scrapes, checkpoints)."""
        self.sim.pause_before(t, on_request=self.feed.on_request)

    def continue_as(self, scenario: Scenario, duration_s: float | None = None,
                    checkpoints: Iterable[float] | None = None) -> None:
        """From the pause on, the run is ``scenario``'s (:meth:`fleet.simulation.Simulation.continue_as`);
        ``checkpoints`` replaces the checkpoints still to come and those kept so far."""
        self.sim.continue_as(scenario, duration_s)
        if checkpoints is not None:
            keep = {round(float(t), 6) for t in checkpoints}
            self.feed.checkpoint_at = keep
            self.feed.checkpoints = {t: v for t, v in self.feed.checkpoints.items() if t in keep}

    def finish(self) -> ScenarioRun:
        feed, sim = self.feed, self.sim
        try:
            result = sim.run(on_request=feed.on_request)
            feed.flush_records()
        finally:
            feed.close()
            sim.close()
        return ScenarioRun(sim.scenario, result, self.state, self.health, feed.history, self.clock, self.start,
                           feed.sent, feed.lost, feed.timeline, feed.checkpoints)


def fired_during_expr(seconds: float) -> str:
    """PromQL naming, once with its step, every alert that was firing at some evaluation in the last ``seconds``
    (but the Watchdog, which always fires: it watches the alerting path, not the fleet). ``group``, not
    ``count``: an alert with several series (an SLO's burn-rate pairs) is still named once, with 1."""
    return (f'group by (alertname, step) (max_over_time(ALERTS{{alertstate="firing", '
            f'alertname!="{catalog.WATCHDOG_ALERT}"}}[{int(seconds)}s]))')


def promtool_test(history: ScrapeHistory, rule_files: Sequence[str],
                  windows: Sequence[tuple[float, float, Iterable[tuple[str, str]]]], name: str = "scenario") -> dict[str, Any]:
    """A ``promtool test rules`` document over ``history``.

    Each window ``(since_s, until_s, expected)`` asserts that exactly the ``(alertname, step)``
    pairs of ``expected`` were firing at some rule evaluation in ``(since_s, until_s]``.
    """
    interval = f"{int(history.interval_s)}s"
    return {
        "rule_files": list(rule_files),
        "evaluation_interval": interval,
        "tests": [{
            "name": name,
            "interval": interval,
            "input_series": history.input_series(),
            "promql_expr_test": [{
                "expr": fired_during_expr(until - since),
                "eval_time": f"{int(until)}s",
                "exp_samples": [{"labels": f'{{alertname="{a}", step="{s}"}}', "value": 1} for a, s in sorted(expected)],
            } for since, until, expected in windows],
        }],
    }
