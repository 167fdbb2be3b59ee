"""``python -m bench.cluster`` (``make bench-cluster``): one exporter process against a simulated fleet.

The whole-system view that ``make bench`` (in-process hot paths) does not give. For each fleet
size N it starts, all on 127.0.0.1:

- N simulated workers, several hundred per load process (``bench._cluster_fleet``): each
  publishes KV-cache events in vLLM's wire format on its own ZMQ PUB socket (with a ROUTER
  replay socket) at the rate set for the phase, and serves vLLM's /metrics;
- one exporter, ``prefixscope export --config.file …`` with the fleet's manifest and a topology
  file (eight workers a node, one NVLink domain a node, so placement is judged from every KV
  store as in a deployment) — the real process, config file and CLI;
- a load generator posting request records as NDJSON in batches over a kept-alive connection
  (``bench._cluster_records``);
- a Prometheus-style scraper that GETs the exporter's /metrics every ``--scrape-every`` seconds
  (this process), timing each answer and reading the exporter's own KV-stream metrics from it.

Then, one phase after another (the load is added a duty at a time; the exporter's CPU is split by
duty from its own ``prefixscope_exporter_duty_cpu_seconds_total``, read off its /metrics at
each window's start and end — or, from an exporter without that series, estimated from its
threads' CPU in /proc, each thread's duty found as the duty is added):

1. ``scrape``: the exporter only scrapes the workers' /metrics (no KV events, no records);
2. ``+kv``: workers publish KV events at ``--rate`` events/s each;
3. ``+records``: records arrive at ``--records-per-worker`` × N per second;
4. ``+render`` (the steady phase, ``--duration`` s): the scraper GETs /metrics. Here the lag,
   RSS, render latency and event accounting are measured;
5. ``ramp``: the per-worker rate is multiplied by ``--ramp-factor`` each ``--step`` seconds
   until the exporter no longer follows (``--ramp`` steps at most; down instead of up when the
   base rate is not followed).

The exporter *follows* a phase when, over the scrapes in it, the largest
``prefixscope_kv_event_lag_seconds`` (receive time minus batch time of each worker's last
batch) is at most ``--max-lag``, no worker's ``prefixscope_kv_event_last_timestamp_seconds``
is older than ``--max-lag`` plus one batch interval (plus however late the load process itself
was to send), and no batch was lost (``prefixscope_kv_event_lost_batches``). The staleness check
is needed because the lag gauge holds only each worker's last applied batch: messages queued
behind a replay, or a stuck subscriber, do not show in it until they are applied. The largest N followed at the base rate is the
largest N one exporter follows here (``--find-max-n`` keeps multiplying N by 1.5 past the list).

``--high-rate`` makes the workers busy: ``bench._cluster_burst`` publishes 64-block events, one a
message, each encoded before the load starts (a send costs the fleet a few microseconds, so it
reaches millions of block events/s on the same cores), N = 1,000 from 10 events/s per worker
raised by √2 a step. Each step reports the block events/s published, the exporter's CPU by duty,
its RSS, the batches it shed (sequence gaps), the replays that healed them and on how many scrapes
``PrefixTelemetryKvIngestLagging``'s expression held; past the first rate not followed, the rate is
held for ``--overload`` seconds (that is where the lag alert and the bounded queues show), then the
load stops and the lag must read 0 again. The report extrapolates the largest rate followed to block
events/s per core of the exporter process and of its KV ingest duty.

The machine matters: the load runs on the same cores as the exporter, and the report says how
many CPU-seconds per second the load itself took.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from bench._cluster_fleet import MODEL, SUBTICK_S, SUBTICKS, Shape
from exporter.sources.kv_zmq import LAG_FLOOR_S

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
P = "prefixscope_"
# the exporter's series this benchmark reads (all from the catalogue's group 0)
LAG = P + "kv_event_lag_seconds"
LAST_TS = P + "kv_event_last_timestamp_seconds"
APPLIED = P + "kv_events_applied_total"
BATCHES = P + "kv_event_batches_total"
MISSED = P + "kv_event_missed_batches_total"
LOST = P + "kv_event_lost_batches_total"
REPLAYS = P + "kv_event_replays_total"
RECORDS = P + "records_ingested_total"
UP = P + "up"
ERRORS = P + "ingest_errors_total"
STARTUP_REPLAY_WAIT_S = 30.0  # after every worker is scraped up, how long the warm caches may take to arrive
LOAD_SHORT = 0.9  # the load fell short when it published less than this share of the rate asked for
READ = (LAG, LAST_TS, APPLIED, BATCHES, MISSED, LOST, REPLAYS, RECORDS, UP, ERRORS)
DUTY_CPU = P + "exporter_duty_cpu_seconds_total"  # the exporter's own CPU per duty (its thread CPU per batch)


# ---- pure parts: reading the exporter's page, summarising ----------------------------------------
@dataclass
class PageValues:
    """What one /metrics page says about the KV streams and intake (values by label string)."""

    series: int = 0
    values: dict[str, dict[str, float]] = field(default_factory=dict)

    def total(self, name: str) -> float:
        return sum(self.values.get(name, {}).values())

    def largest(self, name: str) -> float | None:
        v = self.values.get(name)
        return max(v.values()) if v else None

    def smallest(self, name: str) -> float | None:
        v = self.values.get(name)
        return min(v.values()) if v else None

    def labelled(self, name: str, label: str) -> float:
        return sum(v for lab, v in self.values.get(name, {}).items() if label in lab)

    def count(self, name: str, at_least: float = 0.0, label: str = "") -> int:
        return sum(1 for lab, v in self.values.get(name, {}).items() if v >= at_least and label in lab)


def read_page(text: str, names: Iterable[str] = READ) -> PageValues:
    """The samples of ``names`` on a Prometheus text page (one pass; every other line counted)."""
    wanted = set(names)
    out = PageValues()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        out.series += 1
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if name not in wanted:
            continue
        labels = line[end:line.rfind("}") + 1] if end == brace else ""
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out.values.setdefault(name, {})[labels] = value
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0–1); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


Threads = dict[int, tuple[str, float]]  # thread id -> (name, CPU seconds so far)
DUTIES = ("kv_ingest", "scrape", "records", "render", "other")


def busiest(before: Threads, after: Threads, candidates: Iterable[int]) -> int | None:
    """The candidate thread that used the most CPU between two snapshots (None if none ran)."""
    best, used = None, 0.0
    for tid in candidates:
        if tid in before and tid in after and after[tid][1] - before[tid][1] > used:
            best, used = tid, after[tid][1] - before[tid][1]
    return best


def duty_cpu(page: PageValues) -> dict[str, float] | None:
    """The exporter's own CPU seconds per duty, from its page; None when it does not export them."""
    series = page.values.get(DUTY_CPU)
    if not series:
        return None
    return {labels.split('"')[1]: v for labels, v in series.items() if labels.startswith('{duty="')}


def by_exporter_duty(before: dict[str, float], after: dict[str, float], total: float) -> dict[str, float]:
    """CPU seconds per duty between two readings of the exporter's own counters; ``other`` is the
    rest of the process's ``total`` (work outside the timed batches: start-up, replay fetches,
    file tails, the garbage collector between batches, the HTTP server's accept loop)."""
    out = {d: max(0.0, v - before.get(d, 0.0)) for d, v in after.items()}
    for d in DUTIES[:-1]:
        out.setdefault(d, 0.0)
    out["other"] = max(0.0, total - sum(out.values()))
    return out


def by_duty(before: Threads, after: Threads, roles: dict[int, str], total: float) -> dict[str, float]:
    """CPU seconds per duty between two snapshots: each thread's by its role; ``other`` is the rest of
    the process's ``total`` (unassigned threads, threads that ended, the tree statistics pass)."""
    out = dict.fromkeys(DUTIES, 0.0)
    for tid, role in roles.items():
        if tid in after:
            out[role] += after[tid][1] - before.get(tid, (role, 0.0))[1]
    out["other"] = max(0.0, total - sum(out.values()))
    return out


@dataclass
class Scrape:
    """One GET of the exporter's /metrics and what it said."""

    at: float  # wall clock at the GET's start
    mono: float
    seconds: float
    size: int
    status: int
    series: int = 0
    lag_max: float | None = None
    stale_max: float | None = None  # GET start minus the oldest worker's last KV batch
    applied: float = 0.0
    batches: float = 0.0
    missed: float = 0.0
    lost: float = 0.0
    records: float = 0.0
    recovered: float = 0.0  # replays that healed a gap
    unhealed: float = 0.0  # replays that did not (partial, failed)
    lagging: int = 0  # workers whose lag is above the lag alert's threshold (its expression holds for them)
    rss_mb: float | None = None  # the exporter's RSS when the page was read


def scrape_of(text: str, at: float, mono: float, seconds: float, status: int,
              lag_threshold: float = float("inf")) -> Scrape:
    page = read_page(text)
    oldest = page.smallest(LAST_TS)
    lags = page.values.get(LAG, {}).values()
    return Scrape(at=at, mono=mono, seconds=seconds, size=len(text), status=status, series=page.series,
                  lag_max=page.largest(LAG), stale_max=None if oldest is None else at - oldest,
                  applied=page.total(APPLIED), batches=page.total(BATCHES), missed=page.total(MISSED),
                  lost=page.total(LOST), records=page.total(RECORDS),
                  recovered=page.labelled(REPLAYS, 'result="recovered"'),
                  unhealed=page.total(REPLAYS) - page.labelled(REPLAYS, 'result="recovered"'),
                  lagging=sum(1 for v in lags if v > lag_threshold))


def lag_alert() -> tuple[float, float]:
    """PrefixTelemetryKvIngestLagging's threshold and ``for`` in seconds, from the shipped thresholds
    (its expression: ``max by (cluster, worker) (prefixscope_kv_event_lag_seconds) > threshold``)."""
    from prefixscope.catalog import CHECKS_BY_KEY
    from prefixscope.thresholds import load_thresholds

    check, thresholds = CHECKS_BY_KEY["kv_ingest_lag"], load_thresholds()
    return thresholds.value(check), thresholds.for_s(check)


@dataclass
class Verdict:
    followed: bool
    lag_max_s: float | None
    lag_p50_s: float | None
    stale_max_s: float | None
    lost_batches: float
    missed_batches: float
    applied_per_s: float | None
    scrapes: int
    why: str = ""


def follow_verdict(scrapes: list[Scrape], max_lag: float, batch_interval: float, load_stall: float = 0.0) -> Verdict:
    """Did the exporter follow the KV streams over these scrapes? (see the module docstring)

    A stream may be as stale as the lag allowed plus one batch interval plus ``load_stall``, the
    longest the load process itself was late to send (a busy machine delays the load too).
    """
    ok = [s for s in scrapes if s.status == 200]
    lags = [s.lag_max for s in ok if s.lag_max is not None]
    stale = [s.stale_max for s in ok if s.stale_max is not None]
    lost = ok[-1].lost - ok[0].lost if len(ok) > 1 else 0.0
    missed = ok[-1].missed - ok[0].missed if len(ok) > 1 else 0.0
    span = ok[-1].mono - ok[0].mono if len(ok) > 1 else 0.0
    applied = (ok[-1].applied - ok[0].applied) / span if span > 0 else None
    why = []
    if not lags:
        why.append("no lag measured")
    elif max(lags) > max_lag:
        why.append(f"lag {max(lags):.2f}s > {max_lag:g}s")
    if stale and max(stale) > max_lag + batch_interval + load_stall:
        why.append(f"a stream {max(stale):.2f}s stale")
    if lost > 0:
        why.append(f"{lost:.0f} batches lost")
    if len(ok) < len(scrapes):
        why.append(f"{len(scrapes) - len(ok)} scrape(s) failed")
    return Verdict(followed=not why, lag_max_s=max(lags) if lags else None, lag_p50_s=percentile(lags, 0.5),
                   stale_max_s=max(stale) if stale else None, lost_batches=lost, missed_batches=missed,
                   applied_per_s=applied, scrapes=len(scrapes), why="; ".join(why))


def batch_interval(rate: float, events_per_batch: int = 2) -> float:
    """Seconds between a worker's batches at ``rate`` events/s (``events_per_batch`` a batch: two, a
    store and an eviction, in the spliced fleet; ≥ one tick)."""
    tick = SUBTICKS * SUBTICK_S
    return max(tick, events_per_batch / rate) if rate > 0 else float("inf")


# ---- processes ------------------------------------------------------------------------------------
def bench_topology(workers: list[str], per_node: int = 8) -> dict[str, Any]:
    """The fleet's topology: ``per_node`` workers a node, each node one NVLink domain."""
    return {"schema": "prefixscope.topology/v1", "model": MODEL,
            "gpu_classes": {"H100": {"price_per_gpu_hour": 4.0}},
            "workers": [{"name": w, "node": f"node-{i // per_node}", "nvlink_domain": f"node-{i // per_node}/nvl0",
                         "gpu_class": "H100"} for i, w in enumerate(workers)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu(pid: int) -> Threads:
    """Every live thread's name and CPU seconds (utime + stime), from /proc/<pid>/task."""
    out: Threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # a thread that just ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat.rsplit(")", 1)[1].split()
        out[int(task.name)] = (name, (int(f[11]) + int(f[12])) / CLK_TCK)
    return out


def run_queue_seconds(pid: int) -> float:
    """Time the process's live threads spent runnable but waiting for a CPU (/proc schedstat):
    what a busy machine, not the exporter's own work, adds to its lag."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return total / 1e9


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


class Controlled:
    """A load process driven over stdin/stdout (``rate X``, ``stats``, ``quit``)."""

    def __init__(self, args: list[str], log: IO[bytes]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        self.first = self._line(120)

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not got or not got[0]:
            raise RuntimeError(f"load process {self.proc.args[2]} gave no answer (exit {self.proc.poll()})")
        return json.loads(got[0])

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def rate(self, value: float) -> None:
        self.send(f"rate {value:g}")

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        return self._line(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


class Scraper(threading.Thread):
    """GET /metrics every ``interval`` seconds over a kept-alive connection, like Prometheus."""

    def __init__(self, port: int, interval: float, pid: int | None = None,
                 lag_threshold: float = float("inf")) -> None:
        super().__init__(name="bench-scraper", daemon=True)
        self.port = port
        self.interval = interval
        self.pid = pid  # the exporter's: its RSS is read with each scrape
        self.lag_threshold = lag_threshold
        self.scrapes: list[Scrape] = []
        self.on = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def get(self, conn: http.client.HTTPConnection | None) -> tuple[Scrape, http.client.HTTPConnection | None]:
        at, mono = time.time(), time.monotonic()
        try:
            conn = conn or http.client.HTTPConnection(HOST, self.port, timeout=60)
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            body = resp.read()
            took = time.monotonic() - mono
            scrape = scrape_of(body.decode("utf-8", "replace"), at, mono, took, resp.status, self.lag_threshold)
            if self.pid is not None:
                with contextlib.suppress(OSError):  # the exporter is gone: the next scrape fails too
                    scrape.rss_mb = status_kb(self.pid, "VmRSS") / 1024
            return scrape, conn
        except (OSError, http.client.HTTPException):
            if conn is not None:
                conn.close()
            return Scrape(at=at, mono=mono, seconds=time.monotonic() - mono, size=0, status=0), None

    def run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        next_at = time.monotonic()
        while not self.stop.is_set():
            if not self.on.wait(0.2):
                next_at = time.monotonic()
                continue
            scrape, conn = self.get(conn)
            with self.lock:
                self.scrapes.append(scrape)
            next_at += self.interval
            self.stop.wait(max(0.0, next_at - time.monotonic()))
        if conn is not None:
            conn.close()

    def between(self, start: float, end: float) -> list[Scrape]:
        with self.lock:
            return [s for s in self.scrapes if start <= s.mono <= end]


@dataclass
class Settings:
    sizes: list[int]
    rate: float = 10.0  # KV events/s per worker at the base
    records_per_worker: float = 1.0  # records/s per worker
    duration: float = 60.0  # the steady phase
    phase: float = 15.0  # each CPU-split phase before it
    step: float = 15.0  # each ramp step
    ramp: int = 4  # ramp steps at most (0: none)
    ramp_factor: float = 2.0
    scrape_every: float = 5.0  # the Prometheus-style scraper
    worker_scrape_interval: float = 5.0  # the exporter's scrape_interval for the workers
    workers_per_process: int = 250
    max_lag: float = 1.0
    find_max_n: bool = False
    max_n_limit: int = 5000
    shape: Shape = field(default_factory=Shape)
    keep: bool = False  # keep the run directory (logs) afterwards
    # the high-rate fleet (bench._cluster_burst): messages encoded ahead, ``events_per_batch`` a message
    high_rate: bool = False
    events_per_batch: int = 1
    overload: float = 0.0  # seconds held past the rate the ramp stopped following at (0: none)
    # what each busy worker's PUB socket holds for a subscriber that falls behind: messages, kernel bytes
    pub_hwm: int = 100
    pub_sndbuf: int = 256 * 1024

    @property
    def per_batch(self) -> int:
        """Events a worker's batch carries: the spliced fleet sends a store and an eviction a step."""
        return self.events_per_batch if self.high_rate else 2


HIGH_RATE_SHAPE = Shape(blocks_per_event=64, prefix_blocks=4, families=4, resident_chains=32, cycle_chains=64,
                        capacity_blocks=4096)


class Cluster:
    """One exporter, its simulated fleet and load for one N; ``close()`` stops every process."""

    def __init__(self, n: int, s: Settings, run: Path, log: Callable[[str], None]) -> None:
        self.n, self.s, self.run, self.log = n, s, run, log
        self.loads: list[Controlled] = []
        self.records: Controlled | None = None
        self.exporter: subprocess.Popen[bytes] | None = None
        self.scraper: Scraper | None = None
        self._logs: list[IO[bytes]] = []
        self.startup_unreplayed = 0  # workers whose warm cache the exporter's startup replay did not bring

    def _logfile(self, name: str) -> IO[bytes]:
        f = open(self.run / name, "wb")  # noqa: SIM115 - closed in close()
        self._logs.append(f)
        return f

    def start(self) -> float:
        """Start fleet, exporter and load; returns the seconds the exporter took to follow every worker."""
        s, shape = self.s, json.dumps(asdict(self.s.shape))
        per = max(1, s.workers_per_process)
        manifest: list[dict[str, Any]] = []
        for first in range(0, self.n, per):
            count = min(per, self.n - first)
            fleet = (["bench._cluster_burst", "--events-per-batch", str(s.events_per_batch), "--hwm", str(s.pub_hwm),
                      "--sndbuf", str(s.pub_sndbuf)] if s.high_rate else ["bench._cluster_fleet"])
            load = Controlled([*fleet, "--first", str(first), "--count", str(count), "--shape", shape,
                               "--page-refresh", str(max(s.worker_scrape_interval * 3, 5.0))],
                              self._logfile(f"fleet-{first}.log"))
            self.loads.append(load)
            manifest += load.first["workers"]
        (self.run / "fleet.json").write_text(json.dumps({"workers": manifest}))
        (self.run / "topology.json").write_text(json.dumps(bench_topology([w["name"] for w in manifest])))
        port = free_port()
        self.port = port
        (self.run / "exporter.yaml").write_text(json.dumps({
            "fleet_manifest": "fleet.json",
            "topology": "topology.json",
            "scrape_interval": f"{s.worker_scrape_interval:g}s",
            "scrape_timeout": f"{min(2.0, s.worker_scrape_interval):g}s",
            "limits": {"workers": max(2000, self.n + 10)},
        }, indent=1))
        started = time.monotonic()
        self.exporter = subprocess.Popen(
            [sys.executable, "-m", "prefixscope", "export", "--config.file", str(self.run / "exporter.yaml"),
             "--web.listen-address", f"{HOST}:{port}", "--log.level", "warning"],
            cwd=REPO, env=_env(), stdout=self._logfile("exporter.log"), stderr=subprocess.STDOUT)
        self.records = Controlled(["bench._cluster_records", "--url", f"http://{HOST}:{port}/api/v1/records",
                                   "--workers", str(self.n), "--shape", shape], self._logfile("records.log"))
        self.scraper = Scraper(port, s.scrape_every, self.exporter.pid, lag_alert()[0])
        self.scraper.start()
        # Every worker scraped up and its warm cache (seq 0) applied from the exporter's startup
        # replay; a worker whose startup replay the exporter gave up on is learned from its first
        # live batch (a late join replays from 0), so after a while the workers send a little.
        kv_at = self._wait_following(timeout=60 + 0.1 * self.n, nudge=False)
        self.startup_unreplayed = self.n - kv_at
        if kv_at < self.n:
            self.log(f"N={self.n}: {self.n - kv_at} worker(s) not learned from the startup replay; "
                     "they send a few batches so the exporter joins them")
            self.set_rate(1.0)
            self._wait_following(timeout=60 + 0.1 * self.n, nudge=True)
            self.set_rate(0.0)
            time.sleep(2.0)
        return time.monotonic() - started

    def _wait_following(self, timeout: float, nudge: bool) -> int:
        """Wait until every worker is scraped up and its KV stream applied; returns how many streams are.

        Without ``nudge`` a stream that is not applied by the deadline is returned as missing (the
        caller makes the workers send); with it, that is an error, as is a worker never scraped up.
        """
        deadline = time.monotonic() + timeout
        assert self.scraper is not None and self.exporter is not None
        seen, up, kv = "", 0, 0
        all_up_at: float | None = None
        while time.monotonic() < deadline:
            if not nudge and all_up_at is not None and time.monotonic() - all_up_at > STARTUP_REPLAY_WAIT_S:
                return kv  # the exporter's startup replay is over (it is bounded): the rest comes live
            if self.exporter.poll() is not None:
                raise RuntimeError(f"the exporter exited with {self.exporter.returncode}; see {self.run / 'exporter.log'}")
            try:
                page = read_page(self._page())
            except (OSError, http.client.HTTPException):
                page = None
            if page is not None:
                up = page.count(UP, 1.0, 'kind="worker"')
                kv = page.count(BATCHES, 1.0)
                seen = f"{up}/{self.n} scraped up, {kv}/{self.n} KV streams applied"
                if up >= self.n and all_up_at is None:
                    all_up_at = time.monotonic()
                if up >= self.n and kv >= self.n:
                    return kv
            time.sleep(1.0)
        if up >= self.n and not nudge:
            return kv
        raise RuntimeError(f"the exporter did not follow every worker within {timeout:.0f}s ({seen})")

    def _page(self) -> str:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode("utf-8", "replace")
        finally:
            conn.close()

    # ---- measuring ------------------------------------------------------------------------
    def cpu(self) -> float:
        assert self.exporter is not None
        return cpu_seconds(self.exporter.pid)

    def duty_reading(self) -> dict[str, float] | None:
        """The exporter's own CPU per duty so far (None: not exported, or /metrics did not answer).
        This GET's render is charged to ``render`` within the window it opens."""
        try:
            return duty_cpu(read_page(self._page(), (DUTY_CPU,)))
        except (OSError, http.client.HTTPException):
            return None

    def load_cpu(self) -> float:
        procs = [c.proc for c in self.loads] + ([self.records.proc] if self.records else [])
        return sum(cpu_seconds(p.pid) for p in procs if p.poll() is None)

    def published(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for load in self.loads:
            for k, v in load.stats().items():
                totals[k] = max(totals.get(k, 0.0), float(v)) if k == "stall_s" else totals.get(k, 0.0) + float(v)
        return totals

    def set_rate(self, kv_per_worker: float) -> None:
        for load in self.loads:
            load.rate(kv_per_worker)

    def set_records(self, per_s: float) -> None:
        assert self.records is not None
        self.records.rate(per_s)

    def window(self, seconds: float, settle: float) -> dict[str, Any]:
        """Wait ``settle``, then measure CPU (exporter and load), published events and RSS for the rest."""
        assert self.exporter is not None
        time.sleep(settle)
        if self.exporter.poll() is not None:
            raise RuntimeError(f"the exporter exited with {self.exporter.returncode}; see {self.run / 'exporter.log'}")
        pid = self.exporter.pid
        d0 = self.duty_reading()
        c0, t0, w0, l0 = self.cpu(), thread_cpu(pid), run_queue_seconds(pid), self.load_cpu()
        m0, p0 = time.monotonic(), self.published()
        time.sleep(max(0.5, seconds - settle))
        d1 = self.duty_reading()
        c1, t1, w1, l1 = self.cpu(), thread_cpu(pid), run_queue_seconds(pid), self.load_cpu()
        m1, p1 = time.monotonic(), self.published()
        span = m1 - m0
        return {"start": m0, "end": m1, "threads": (t0, t1), "duty_cpu": (d0, d1), "cpu": (c1 - c0) / span,
                "cpu_s": c1 - c0, "run_queue": max(0.0, w1 - w0) / span,
                "load_cpu": (l1 - l0) / span,
                "events_per_s": (p1.get("events", 0) - p0.get("events", 0)) / span,
                "blocks_per_s": (p1.get("blocks", 0) - p0.get("blocks", 0)) / span,
                "load_stall_s": p1.get("stall_s", 0.0),
                "rss_mb": status_kb(self.exporter.pid, "VmRSS") / 1024}

    def close(self) -> None:
        if self.scraper is not None:
            self.scraper.stop.set()
        if self.exporter is not None and self.exporter.poll() is None:
            self.exporter.send_signal(signal.SIGTERM)
            try:
                self.exporter.wait(15)
            except subprocess.TimeoutExpired:
                self.exporter.kill()
                self.exporter.wait(5)
        for c in [*self.loads, *([self.records] if self.records else [])]:
            c.close()
        for f in self._logs:
            f.close()


def run_size(n: int, s: Settings, log: Callable[[str], None] = print, ramp: bool = True) -> dict[str, Any]:
    """Start a cluster of ``n`` workers, run the phases, return this size's results."""
    run = Path(tempfile.mkdtemp(prefix=f"prefixscope-bench-cluster-{n}-"))
    cluster = Cluster(n, s, run, log)
    settle = min(3.0, s.phase / 3)
    try:
        startup = cluster.start()
        log(f"N={n}: following every worker {startup:.1f}s after the exporter started "
            f"({len(cluster.loads)} load process(es); logs in {run})")
        assert cluster.scraper is not None and cluster.exporter is not None
        phases, roles = _duty_phases(cluster, s, n, settle)
        steady = phases["render"]
        steady["requested_events_per_s"] = s.rate * n
        scrapes = cluster.scraper.between(steady["start"], steady["end"])
        verdict = follow_verdict(scrapes, s.max_lag, batch_interval(s.rate, s.per_batch), steady["load_stall_s"])
        log(f"N={n}: base rate {s.rate:g} events/s per worker: "
            f"{'followed' if verdict.followed else 'NOT followed (' + verdict.why + ')'}")
        steps = _ramp(cluster, s, n, verdict.followed, roles, settle) if ramp and s.ramp > 0 else []
        overload = None
        if s.overload > 0 and ramp:  # a step past the lowest rate not followed (or past the last, if all were)
            tried = [(s.rate, verdict.followed)] + [(st["rate_per_worker"], st["followed"]) for st in steps]
            missed = [rate for rate, ok in tried if not ok]
            past = min(missed) if missed else max(rate for rate, _ in tried)
            overload = _overload(cluster, s, n, past * s.ramp_factor, roles)
        accounting = _drain(cluster)
        # the best rate followed, as published (the load may fall short of what was asked on a busy machine)
        followed = [(s.rate, steady["events_per_s"], steady["blocks_per_s"], steady["cpu"],
                     _duties(steady, roles)["kv_ingest"])] if verdict.followed else []
        followed += [(st["rate_per_worker"], st["events_per_s"], st["blocks_per_s"], st["cpu"],
                      st["cpu_by_duty"]["kv_ingest"]) for st in steps if st["followed"]]
        best = max(followed) if followed else None
        render = [x.seconds for x in scrapes if x.status == 200]
        ok = [x for x in scrapes if x.status == 200]
        result = {
            "workers": n, "load_processes": len(cluster.loads), "startup_s": startup,
            "startup_unreplayed_workers": cluster.startup_unreplayed,
            "rate_per_worker": s.rate, "records_per_s": s.records_per_worker * n,
            "cpu": {**_duties(steady, roles), "total": steady["cpu"]},
            "cpu_split": "exporter" if _exporter_split(steady) else "threads",
            "threads_by_duty": {d: sum(1 for r in roles.values() if r == d) for d in DUTIES[:-1]},
            "cpu_added_by_phase": {"scrape": phases["scrape"]["cpu"],
                                   "kv_ingest": phases["kv"]["cpu"] - phases["scrape"]["cpu"],
                                   "records": phases["records"]["cpu"] - phases["kv"]["cpu"],
                                   "render": phases["render"]["cpu"] - phases["records"]["cpu"]},
            "load_cpu": steady["load_cpu"],
            "run_queue": steady["run_queue"],
            "phases": {k: {kk: vv for kk, vv in v.items() if kk not in ("start", "end", "threads", "duty_cpu")}
                       for k, v in phases.items()},
            "rss_mb": steady["rss_mb"], "rss_peak_mb": status_kb(cluster.exporter.pid, "VmHWM") / 1024,
            "render": {"p50_s": percentile(render, 0.5), "p99_s": percentile(render, 0.99),
                       "max_s": max(render) if render else None, "scrapes": len(render),
                       "bytes": ok[-1].size if ok else None, "series": ok[-1].series if ok else None},
            "kv": {"events_per_s": steady["events_per_s"], "blocks_per_s": steady["blocks_per_s"],
                   **_verdict_fields(verdict), **accounting},
            "followed": verdict.followed,
            "ramp": steps,
            "overload": overload,
            "blocks_per_event": s.shape.blocks_per_event, "events_per_batch": s.per_batch,
            "fleet": "prebuilt (bench._cluster_burst)" if s.high_rate else "spliced (bench._cluster_fleet)",
            "max_followed_rate_per_worker": None if best is None else best[0],
            "max_followed_events_per_s": None if best is None else best[1],
            "max_followed_blocks_per_s": None if best is None else best[2],
            # at that rate: block events/s per core of the whole exporter process and of its KV ingest duty
            "blocks_per_exporter_core": None if best is None or not best[3] else best[2] / best[3],
            "blocks_per_kv_ingest_core": None if best is None or not best[4] else best[2] / best[4],
            "load_short": any(w["events_per_s"] < LOAD_SHORT * w["requested_events_per_s"]
                              for w in [steady, *steps]),
        }
        return result
    finally:
        cluster.close()
        if not s.keep:
            for f in run.iterdir():
                f.unlink()
            run.rmdir()


def _duty_phases(cluster: Cluster, s: Settings, n: int,
                 settle: float) -> tuple[dict[str, dict[str, Any]], dict[int, str]]:
    """The phases that add one duty at a time (the last, ``render``, is the steady phase), and
    which exporter thread does which duty."""
    assert cluster.scraper is not None and cluster.exporter is not None
    phases: dict[str, dict[str, Any]] = {}
    # Which exporter thread does which duty, found as each duty is added: ZMQ's own I/O threads
    # and the thread that gets busy with KV events ingest them; the one busy with nothing else
    # on scrapes the workers; threads born with the record load (its kept-alive connection) or
    # with the scraper (its connection) take records and render /metrics.
    roles: dict[int, str] = {}
    born = set(thread_cpu(cluster.exporter.pid))
    phases["scrape"] = cluster.window(s.phase, settle)
    roles.update(_assign(phases["scrape"], born, roles, "scrape"))
    born.update(phases["scrape"]["threads"][1])
    cluster.set_rate(s.rate)
    phases["kv"] = cluster.window(s.phase, settle)
    roles.update(_assign(phases["kv"], born, roles, "kv_ingest"))
    roles.update({tid: "kv_ingest" for tid, (name, _) in phases["kv"]["threads"][1].items()
                  if name.startswith("ZMQbg/")})
    born.update(phases["kv"]["threads"][1])  # replay threads and the like stay "other"
    cluster.set_records(s.records_per_worker * n)
    phases["records"] = cluster.window(s.phase, settle)
    roles.update({tid: "records" for tid in _new_threads(phases["records"], born, roles)})
    cluster.scraper.on.set()
    phases["render"] = cluster.window(s.duration, settle)
    roles.update({tid: "render" for tid in _new_threads(phases["render"], born, roles)})
    return phases, roles


def _ramp(cluster: Cluster, s: Settings, n: int, base_followed: bool, roles: dict[int, str],
          settle: float) -> list[dict[str, Any]]:
    """Multiply the rate each step while followed (divide while not) until that changes."""
    assert cluster.scraper is not None
    steps: list[dict[str, Any]] = []
    factor = s.ramp_factor if base_followed else 1 / s.ramp_factor
    rate = s.rate
    for _ in range(s.ramp):
        rate *= factor
        cluster.set_rate(rate)
        w = cluster.window(s.step, min(settle, s.step / 3))
        scrapes = cluster.scraper.between(w["start"], w["end"])
        v = follow_verdict(scrapes, s.max_lag, batch_interval(rate, s.per_batch), w["load_stall_s"])
        w["requested_events_per_s"] = rate * n
        duties = _duties(w, roles)
        steps.append({"rate_per_worker": rate, "events_per_s": w["events_per_s"], "blocks_per_s": w["blocks_per_s"],
                      "requested_events_per_s": rate * n, "cpu": w["cpu"], "cpu_by_duty": duties,
                      "run_queue": w["run_queue"], "load_cpu": w["load_cpu"], "load_stall_s": w["load_stall_s"],
                      "rss_mb": w["rss_mb"], **_shedding(scrapes), **_verdict_fields(v),
                      # per scrape: (seconds into the step, largest lag, stalest stream)
                      "scrape_series": [(round(x.mono - w["start"], 1), x.lag_max, x.stale_max)
                                        for x in scrapes if x.status == 200]})
        cluster.log(f"N={n}: ramp {rate:g} events/s per worker ({w['events_per_s']:.0f}/s, "
            f"{w['blocks_per_s']:,.0f} block events/s): "
            f"{'followed' if v.followed else 'NOT followed (' + v.why + ')'}, lag max "
            f"{_fmt_s(v.lag_max_s)}, exporter CPU {w['cpu']:.2f} (KV ingest {duties['kv_ingest']:.2f}), "
            f"waiting for a CPU {w['run_queue']:.2f}, load CPU {w['load_cpu']:.2f}, RSS {w['rss_mb']:.0f} MB")
        if v.followed != base_followed:
            break
    return steps


def _shedding(scrapes: list[Scrape]) -> dict[str, Any]:
    """What the exporter said about falling behind over these scrapes: the workers its lag alert's
    expression held for, the gaps it shed into and the replays that healed them (or not), its RSS."""
    ok = [x for x in scrapes if x.status == 200]
    rss = [x.rss_mb for x in ok if x.rss_mb is not None]

    def grew(name: str) -> float:
        return getattr(ok[-1], name) - getattr(ok[0], name) if len(ok) > 1 else 0.0

    return {"lagging_workers_max": max((x.lagging for x in ok), default=0),
            "alert_expr_scrapes": sum(1 for x in ok if x.lagging), "scrapes_ok": len(ok),
            "missed_batches_grew": grew("missed"), "replays_recovered": grew("recovered"),
            "replays_unhealed": grew("unhealed"), "lost_grew": grew("lost"),
            "rss_mb_first": rss[0] if rss else None, "rss_mb_max": max(rss) if rss else None,
            "rss_mb_last": rss[-1] if rss else None}


def _overload(cluster: Cluster, s: Settings, n: int, rate: float, roles: dict[int, str]) -> dict[str, Any]:
    """Hold ``rate`` (past what is followed) for ``s.overload`` seconds: does the exporter say so
    (its lag, the lag alert's expression) and shed into gaps and replays with a bounded RSS? Then
    stop the load and see the lag go back to 0 once the backlog is applied."""
    assert cluster.scraper is not None
    threshold, for_s = lag_alert()
    cluster.set_rate(rate)
    w = cluster.window(s.overload, min(3.0, s.overload / 4))
    scrapes = cluster.scraper.between(w["start"], w["end"])
    v = follow_verdict(scrapes, s.max_lag, batch_interval(rate, s.per_batch), w["load_stall_s"])
    held = [x for x in scrapes if x.status == 200]
    firing_from = next((x.mono for x in held if x.lagging), None)
    out = {"rate_per_worker": rate, "seconds": w["end"] - w["start"], "events_per_s": w["events_per_s"],
           "blocks_per_s": w["blocks_per_s"], "cpu": w["cpu"], "cpu_by_duty": _duties(w, roles),
           "run_queue": w["run_queue"], "load_cpu": w["load_cpu"], "rss_mb": w["rss_mb"],
           "lag_alert_threshold_s": threshold, "lag_alert_for_s": for_s,
           # the expression held on every scrape from its first one to the end: for this long (the alert
           # fires once that passes its ``for``)
           "alert_expr_held_s": (held[-1].mono - firing_from) if firing_from is not None
           and all(x.lagging for x in held if x.mono >= firing_from) else 0.0,
           "lag_series_s": [(round(x.mono - w["start"], 1), x.lag_max) for x in held],
           "rss_series_mb": [(round(x.mono - w["start"], 1), x.rss_mb) for x in held],
           **_shedding(scrapes), **_verdict_fields(v)}
    cluster.set_rate(0)
    after: list[Scrape] = []
    for _ in range(30):  # the backlog applied and the replays back: lag read 0 again
        time.sleep(1.0)
        after.append(cluster.scraper.get(None)[0])
        if after[-1].status == 200 and after[-1].lag_max is not None and after[-1].lag_max < LAG_FLOOR_S:
            break
    last = after[-1] if after else None
    out["after_stop"] = {"seconds": len(after), "lag_max_s": None if last is None else last.lag_max,
                         "lagging_workers": None if last is None else last.lagging}
    cluster.log(f"N={n}: held {rate:g} events/s per worker ({w['blocks_per_s']:,.0f} block events/s) for "
                f"{out['seconds']:.0f}s: lag max {_fmt_s(v.lag_max_s)}, the lag alert's expression (> {threshold:g}s) "
                f"held for {out['alert_expr_held_s']:.0f}s on up to {out['lagging_workers_max']} workers, "
                f"{out['missed_batches_grew']:.0f} batches shed, {out['replays_recovered']:.0f} replays healed, "
                f"{out['replays_unhealed']:.0f} not; RSS {_fmt(out['rss_mb_first'], '.0f')} → "
                f"max {_fmt(out['rss_mb_max'], '.0f')} MB; after the load stopped, lag max "
                f"{_fmt_s(out['after_stop']['lag_max_s'])} in {out['after_stop']['seconds']}s")
    return out


def _assign(window: dict[str, Any], born: set[int], roles: dict[int, str], role: str) -> dict[int, str]:
    """The busiest thread of those there from the start and not yet assigned gets ``role``."""
    before, after = window["threads"]
    tid = busiest(before, after, (t for t in born if t not in roles and not after.get(t, ("", 0))[0].startswith("ZMQ")))
    return {} if tid is None else {tid: role}


def _new_threads(window: dict[str, Any], born: set[int], roles: dict[int, str]) -> list[int]:
    """Threads alive at the window's end that were not there at the start of the run nor assigned."""
    after = window["threads"][1]
    fresh = [t for t in after if t not in born and t not in roles]
    born.update(fresh)
    return fresh


def _exporter_split(window: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]] | None:
    d0, d1 = window["duty_cpu"]
    return None if d0 is None or d1 is None else (d0, d1)


def _duties(window: dict[str, Any], roles: dict[int, str]) -> dict[str, float]:
    """CPU-seconds per second by duty: the exporter's own counters, else the /proc thread estimate."""
    span = window["end"] - window["start"]
    own = _exporter_split(window)
    if own is not None:
        split = by_exporter_duty(*own, window["cpu_s"])
    else:
        before, after = window["threads"]
        split = by_duty(before, after, roles, window["cpu_s"])
    return {k: v / span for k, v in split.items()}


def _verdict_fields(v: Verdict) -> dict[str, Any]:
    return {"followed": v.followed, "lag_max_s": v.lag_max_s, "lag_p50_s": v.lag_p50_s, "stale_max_s": v.stale_max_s,
            "lost_batches": v.lost_batches, "missed_batches": v.missed_batches, "applied_per_s": v.applied_per_s,
            "why": v.why}


def _drain(cluster: Cluster) -> dict[str, Any]:
    """Stop the load, wait until the exporter has applied what it will, compare with what was published."""
    cluster.set_rate(0)
    cluster.set_records(0)
    assert cluster.scraper is not None
    cluster.scraper.on.clear()
    published = cluster.published()
    applied_before = -1.0
    page = read_page(cluster._page())
    for _ in range(15):
        if page.total(APPLIED) == applied_before:
            break
        applied_before = page.total(APPLIED)
        time.sleep(1.0)
        page = read_page(cluster._page())
    assert cluster.records is not None
    rec = cluster.records.stats()
    return {"published_events": published.get("events", 0.0), "applied_events": page.total(APPLIED),
            "published_batches": published.get("batches", 0.0), "received_batches": page.total(BATCHES),
            "missed_batches_total": page.total(MISSED), "lost_batches_total": page.total(LOST),
            "kv_ingest_errors": page.labelled(ERRORS, 'source="kv_events"'),
            "records_ingest_errors": page.labelled(ERRORS, 'source="records"'),
            "records_posted": rec.get("posted"), "records_accepted": rec.get("accepted"),
            "records_rejected": rec.get("rejected"), "records_post_errors": rec.get("errors"),
            "records_ingested": page.total(RECORDS)}


# ---- report -------------------------------------------------------------------------------------
def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = ("N", "KV ev/s", "followed", "lag max", "max ev/s followed", "CPU total", "kv", "scrape", "records",
           "render", "tree stats", "other", "CPU wait", "load CPU", "RSS MB", "/metrics p50", "p99", "series")


def table(results: list[dict[str, Any]]) -> str:
    rows = [list(COLUMNS)]
    for r in results:
        kv, cpu, render = r["kv"], r["cpu"], r["render"]
        shown = ("kv_ingest", "scrape", "records", "render", "tree_statistics")
        other = sum(v for d, v in cpu.items() if d not in (*shown, "total"))  # otlp, breach, untimed
        best = r["max_followed_events_per_s"]
        ramped = r["ramp"] and all(st["followed"] for st in r["ramp"]) and r["followed"]
        rows.append([
            f"{r['workers']:,}", f"{kv['events_per_s']:,.0f}", "yes" if r["followed"] else "NO",
            _fmt_s(kv["lag_max_s"]),
            "-" if best is None else f"{'≥ ' if ramped else ''}{best:,.0f}",
            _fmt(cpu["total"]), _fmt(cpu["kv_ingest"]), _fmt(cpu["scrape"]), _fmt(cpu["records"]),
            _fmt(cpu["render"]), _fmt(cpu.get("tree_statistics")), _fmt(other), _fmt(r["run_queue"]), _fmt(r["load_cpu"]), f"{r['rss_mb']:.0f}",
            _fmt_s(render["p50_s"]), _fmt_s(render["p99_s"]), _fmt(render["series"], ",.0f"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


RAMP_COLUMNS = ("N", "step", "events/s a worker", "block ev/s", "followed", "lag max", "alert expr (workers)",
                "CPU total", "kv", "CPU wait", "load CPU", "RSS MB", "batches shed", "replays healed / not")


def ramp_table(results: list[dict[str, Any]]) -> str:
    """Each size's ramp steps and its hold past capacity, one row each (the high-rate mode's view)."""
    rows = [list(RAMP_COLUMNS)]
    for r in results:
        steps = [("ramp", st) for st in r["ramp"]] + ([("held", r["overload"])] if r.get("overload") else [])
        for kind, st in steps:
            rows.append([f"{r['workers']:,}", kind, f"{st['rate_per_worker']:.3g}", f"{st['blocks_per_s']:,.0f}",
                         "yes" if st["followed"] else "NO", _fmt_s(st["lag_max_s"]),
                         f"{st['alert_expr_scrapes']}/{st['scrapes_ok']} ({st['lagging_workers_max']})",
                         _fmt(st["cpu"]), _fmt(st["cpu_by_duty"]["kv_ingest"]), _fmt(st["run_queue"]),
                         _fmt(st["load_cpu"]), f"{st['rss_mb_max'] or st['rss_mb']:.0f}",
                         f"{st['missed_batches_grew']:,.0f}",
                         f"{st['replays_recovered']:,.0f} / {st['replays_unhealed']:,.0f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(RAMP_COLUMNS))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def report(results: list[dict[str, Any]], s: Settings, machine: dict[str, Any]) -> dict[str, Any]:
    followed = [r["workers"] for r in results if r["followed"]]
    return {"machine": machine, "settings": {k: v for k, v in asdict(s).items() if k != "sizes"},
            "sizes": results, "largest_n_followed": max(followed) if followed else None}


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0], "python": sys.version.split()[0]}


def settings_from(args: argparse.Namespace) -> Settings:
    if args.high_rate and args.quick:  # the mechanics: a short ramp past a small fleet's rate, a short hold
        s = Settings(sizes=[30], rate=20, records_per_worker=0.25, duration=10, phase=3, step=6, ramp=2,
                     ramp_factor=4, scrape_every=2, worker_scrape_interval=2, workers_per_process=500,
                     shape=HIGH_RATE_SHAPE, high_rate=True, overload=12)
    elif args.high_rate:  # 1,000 busy workers, 64-block events one a message, the rate raised by √2 a step
        s = Settings(sizes=[1000], rate=10, records_per_worker=0.25, duration=30, phase=10, step=20, ramp=8,
                     ramp_factor=2 ** 0.5, workers_per_process=500, shape=HIGH_RATE_SHAPE, high_rate=True,
                     overload=60)
    elif args.quick:
        s = Settings(sizes=[10, 30], duration=12, phase=3, step=5, ramp=1, scrape_every=2,
                     worker_scrape_interval=2)
    else:
        s = Settings(sizes=[100, 300, 1000])
    for name in ("rate", "records_per_worker", "duration", "phase", "step", "ramp", "ramp_factor", "scrape_every",
                 "worker_scrape_interval", "workers_per_process", "max_lag", "max_n_limit", "events_per_batch",
                 "overload", "pub_hwm"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.workers:
        s.sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    s.find_max_n, s.keep = args.find_max_n, args.keep
    s.step = max(s.step, 3 * s.scrape_every)  # a verdict needs a few scrapes
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", help="comma-separated fleet sizes N (default 100,300,1000; --quick 10,30)")
    p.add_argument("--quick", action="store_true", help="small N, short phases: check the mechanics in ~2 minutes")
    p.add_argument("--rate", type=float, help="KV events/s per worker at the base (default 10)")
    p.add_argument("--records-per-worker", type=float, help="records/s per worker (default 1)")
    p.add_argument("--duration", type=float, help="seconds of the steady phase (default 60)")
    p.add_argument("--phase", type=float, help="seconds of each CPU-split phase before it (default 15)")
    p.add_argument("--step", type=float, help="seconds of each ramp step (default 15)")
    p.add_argument("--ramp", type=int, help="ramp steps at most, 0 for none (default 4)")
    p.add_argument("--ramp-factor", type=float, help="rate multiplier per ramp step (default 2)")
    p.add_argument("--scrape-every", type=float, help="seconds between the scraper's GETs of /metrics (default 5)")
    p.add_argument("--worker-scrape-interval", type=float, help="the exporter's scrape_interval (default 5)")
    p.add_argument("--workers-per-process", type=int, help="simulated workers per load process (default 250)")
    p.add_argument("--max-lag", type=float, help="lag the exporter may have and still follow (default 1 s)")
    p.add_argument("--find-max-n", action="store_true",
                   help="after the list, keep multiplying N by 1.5 (base rate, no ramp) until it is not followed")
    p.add_argument("--max-n-limit", type=int, help="largest N --find-max-n tries (default 5000)")
    p.add_argument("--keep", action="store_true", help="keep each size's run directory (config, logs)")
    p.add_argument("--high-rate", action="store_true",
                   help="busy workers (bench._cluster_burst): 64-block events encoded ahead, one a message; "
                        "N = 1,000 from 10 events/s each, ×√2 a step until not followed, then held past that "
                        "(with --quick: N = 30, a short ramp and hold)")
    p.add_argument("--events-per-batch", type=int, help="--high-rate: events a message carries (default 1)")
    p.add_argument("--pub-hwm", type=int,
                   help="--high-rate: messages each worker's PUB socket holds for the exporter (default 100; with "
                        "a 256 KiB socket buffer); past them it drops and the exporter replays the gap")
    p.add_argument("--overload", type=float,
                   help="seconds held past the rate the ramp stopped following (default 0; --high-rate 60)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout (progress on stderr)")
    args = p.parse_args(argv)
    s = settings_from(args)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    m = machine()
    log(f"bench.cluster: N = {', '.join(map(str, s.sizes))}; {s.rate:g} KV events/s and "
        f"{s.records_per_worker:g} records/s per worker; {m['cpus']} CPUs, load average {m['loadavg_at_start']:.1f}")
    results = []
    for n in s.sizes:
        results.append(run_size(n, s, log))
    if s.find_max_n and results and results[-1]["followed"]:
        n = max(s.sizes)
        while True:
            n = int(n * 1.5)
            if n > s.max_n_limit:
                break
            r = run_size(n, s, log, ramp=False)
            results.append(r)
            if not r["followed"]:
                break
    out = report(results, s, m)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print()
        print(table(results))
        print(f"\nCPU in CPU-seconds per second (cores) of the exporter process in the steady phase, by duty from its "
              f"own prefixscope_exporter_duty_cpu_seconds_total (other: the OTLP and breach duties and untimed work; "
              f"the JSON has each), or, without that series, from the threads doing each (tree stats: -; other: "
              f"the tree statistics pass, the breach loop, ended threads); "
              f"CPU wait is the time its threads were runnable but waiting for a core (a busy machine); "
              f"load CPU is the simulated fleet and record load on the same machine.\n"
              f"largest N followed at {s.rate:g} events/s per worker: {out['largest_n_followed'] or 'none'}")
        if any(r["ramp"] or r.get("overload") for r in results):
            threshold, for_s = lag_alert()
            print(f"\n{ramp_table(results)}\n\nblock ev/s: published by the fleet; alert expr: the scrapes on which "
                  f"PrefixTelemetryKvIngestLagging's expression (lag > {threshold:g} s) held for some worker (the "
                  f"most workers at once; it fires after {for_s:g} s of that); RSS: the largest read with a scrape.")
            for r in results:
                if r["max_followed_blocks_per_s"] is not None:
                    print(f"N = {r['workers']:,}: followed up to {r['max_followed_blocks_per_s']:,.0f} block events/s "
                          f"({r['blocks_per_event']}-block events, {r['events_per_batch']} a batch): "
                          f"{_fmt(r['blocks_per_exporter_core'], ',.0f')} per core of the exporter process, "
                          f"{_fmt(r['blocks_per_kv_ingest_core'], ',.0f')} per core of its KV ingest duty "
                          "(the fleet on the same cores)")
        short = [r["workers"] for r in results if r["load_short"]]
        if short:
            print(f"the load published under {LOAD_SHORT:.0%} of the asked rate at N = {', '.join(map(str, short))}: "
                  "the machine, not the exporter, set the ceiling there (see the JSON's ramp)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
