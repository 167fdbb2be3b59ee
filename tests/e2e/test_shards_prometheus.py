"""Three family shards and a real Prometheus with the generated rules give one exporter's answer.

One exporter and three family shards (``exporter.core.sharding``: every shard reads every KV batch and
every record and keeps its families' part) ingest the same traffic on one driven clock; every
15 s of it, each one's /metrics page is rendered by its collector and kept, as Prometheus would
scrape it (the shards under their own ``instance`` labels). Two real Prometheus servers then hold
that history with the generated recording rules evaluated over it by Prometheus's engine
(:mod:`tests.e2e.rules_prometheus`): one over the single exporter's series, one over the three
shards'. Compared:

* every recording rule's every series, at several instants over the last ten minutes: the
  shards' Prometheus gives the single exporter's numbers (ratios of rates and rates to 1e-9
  relative, quantiles to 1e-6 relative — the same bucket sums through the same interpolation;
  see ``RATIO_TOL`` and ``QUANTILE_TOL``);
* the console's reading of each Prometheus (``console.data.chain_from_prom``: the checks'
  values and statuses, the five groups' statuses, the chain's verdict, the reuse shares): the
  same from both;
* and the single exporter's own ``/api/v1/groups`` at the same instant (``console.chain
  .chain_from_exporter``): the same verdict, and the same checks past their thresholds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from console import data as console_data
from console.chain import Chain, chain_from_exporter
from console.limits import Limits, limits_from_groups
from console.links import GENERATED_RULES
from console.prom import PrometheusClient, Sample
from exporter.bootstrap import ExporterParts
from exporter.codecs import promtext
from exporter.core.sharding import ShardSpec
from exporter.web import api
from lab.harness import ScrapeHistory, series_key
from prefixscope import catalog
from tests.e2e.rules_prometheus import EVAL_INTERVAL_S, RulesPrometheus, recording_rules
from tests.scale.test_shard_answer import T0, Exp, exporter, workload
from tests.support import REPO, free_port, require_file, require_tool, wait_for

pytestmark = pytest.mark.slow

SHARDS = 3
STEP_S = 0.5  # the workload's spacing of requests
STEPS = 1500  # 12.5 minutes of traffic: the last 5m windows lie well after every counter began
SCRAPE_EVERY_S = 15.0
SPAN_S = STEPS * STEP_S
# Cluster-wide rules over the 5m window: the same sums of the same integers, divided (ratios,
# rates); quantiles interpolate the same summed buckets, up to floating-point rounding.
RATIO_TOL = 1e-9
QUANTILE_TOL = 1e-6
# Where Prometheus's rate extrapolation differs between one series and its parts: ``rate`` does
# not extrapolate a counter back past its estimated zero (its first value in the window over its
# increase), and a series born inside the window is extrapolated by half a scrape interval. A
# shard's part of a per-worker counter or bucket can be born late or be small where the whole
# is not, so per-worker rules (and histograms of few observations) pool within a few percent;
# windows longer than the traffic (30m, 1h, 6h, the 1d baseline) contain every counter's birth
# and pool within 0.5 %; their quantiles lie within one bucket of each other (``agrees``). The
# counters themselves pool exactly at every instant (asserted too).
PER_WORKER_TOL = 5e-2
LONG_WINDOW_TOL = 5e-3
INSTANTS_S = (0, 60, 120, 180, 240, 300)  # before the end of the traffic


def exposition(parts: ExporterParts, instance: str) -> dict[str, float]:
    """What Prometheus stores from one scrape of the exporter's /metrics (its collector's page)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(parts.collector)
    parsed = promtext.parse(generate_latest(registry).decode())
    assert not parsed.errors, parsed.errors[:3]
    return {series_key(name, {**s.labels, "job": "prefixscope", "instance": instance}): s.value
            for name, samples in parsed.samples.items() if not name.endswith("_created") for s in samples}


@dataclasses.dataclass
class Run:
    single: Exp
    shards: list[Exp]
    one: ScrapeHistory  # the single exporter's scrapes
    many: ScrapeHistory  # the three shards' scrapes, side by side
    start: float  # Unix time of the first scrape
    end: float  # ... of the last
    groups: dict  # the single exporter's /api/v1/groups at the end


def drive(seed: int) -> Run:
    """The workload of tests.scale.test_shard_answer on a clock ending about now, scraped every 15 s."""
    # A whole minute: the scrapes, Prometheus's evaluations and the queried instants fall at the same
    # offsets in every run (per-worker rates extrapolate a late-born part by where its first scrape
    # falls in the window, so an arbitrary second could move a per-worker ratio past its tolerance).
    start = float(math.floor((time.time() - SPAN_S) / 60.0) * 60.0)
    clock = [start]
    single = exporter(ShardSpec(), clock)
    shards = [exporter(ShardSpec(i, SHARDS), clock) for i in range(SHARDS)]
    one, many = ScrapeHistory(SCRAPE_EVERY_S), ScrapeHistory(SCRAPE_EVERY_S)
    every = round(SCRAPE_EVERY_S / STEP_S)

    def scrape(t: float) -> None:
        for e in [single, *shards]:
            e.parts.state.refresh_tree_stats()  # the live exporter's background pass
        one.add(t, exposition(single.parts, "single"))
        pages: dict[str, float] = {}
        for i, s in enumerate(shards):
            pages |= exposition(s.parts, f"shard{i}")
        many.add(t, pages)

    scrape(0.0)
    for step, (ts, batch, rec) in enumerate(workload(seed, STEPS), start=1):
        now = ts - T0 + start + STEP_S  # request i arrives in step i's half second
        clock[0] = now
        batch = dataclasses.replace(batch, ts=now)
        rec = dataclasses.replace(rec, ts=now)
        for e in [single, *shards]:
            e.kv.apply_kv_batch(batch, now)
            e.records.ingest_records([rec], now)  # every shard is sent every record
        if step % every == 0:
            scrape(now - start)
    end = clock[0]
    assert math.isclose(end - start, one.times[-1], abs_tol=1e-6)
    return Run(single, shards, one, many, start, end, api.groups(single.parts.state))


@pytest.fixture(scope="module")
def run() -> Run:
    return drive(seed=5)


@pytest.fixture(scope="module")
def proms(run: Run, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RulesPrometheus, RulesPrometheus]]:
    prometheus, promtool = require_tool("prometheus"), require_tool("promtool")
    rules = require_file(GENERATED_RULES, "the generated rules (run prefixscope generate)")
    made: list[RulesPrometheus] = []
    try:
        for name, history in (("single", run.one), ("shards", run.many)):
            made.append(RulesPrometheus(prometheus, promtool, history, run.start, run.end, rules,
                                        tmp_path_factory.mktemp(name)))
        yield made[0], made[1]
    finally:
        for p in made:
            p.stop()


def _reads(expr: str, seen: frozenset[str] = frozenset()) -> str:
    """A rule's expression with the rules it reads written out (their windows and quantiles), each
    once on a path (the healthy-window baseline reads its own past)."""
    return expr + "".join(_reads(r.expr, seen | {n}) for n, r in catalog.RULES_BY_NAME.items()
                          if n not in seen and re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])", expr))


def tolerance(expr: str) -> float:
    """How closely a rule (or a check's expression) over the shards must equal one exporter's."""
    full = _reads(expr)
    if "worker:" in full:
        return PER_WORKER_TOL
    if re.search(r"\[(30m|\d+h|\d+d)\]", full):
        return LONG_WINDOW_TOL
    return QUANTILE_TOL if "histogram_quantile" in full else RATIO_TOL


def same(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=tol, abs_tol=1e-12)


_QUANTILE_OF = re.compile(r"histogram_quantile\([\d.]+, sum by \([^)]*\) \(rate\((\w+)_bucket")


def agrees(expr: str, want: float, got: float) -> bool:
    """The shards' value of ``expr`` is one exporter's within the rule's tolerance. A quantile whose
    buckets' rates are extrapolated per part (per worker, or windows longer than the traffic) lies
    within one bucket of one exporter's: the shift of a bucket's share moves the interpolation
    inside the bucket, or just across its edge."""
    full = _reads(expr)
    tol = tolerance(expr)
    if tol > QUANTILE_TOL and (m := _QUANTILE_OF.search(full)) and not (math.isnan(want) or math.isnan(got)):
        bounds = sorted(catalog.METRICS_BY_NAME[m[1]].buckets or ())
        hi = next((b for b in bounds if b >= want), bounds[-1])
        lo = max((b for b in bounds if b < hi), default=0.0)
        return abs(got - want) <= hi - lo or same(got, want, tol)
    return same(got, want, tol)


def test_every_recording_rule_over_the_shards_is_one_exporters(run: Run, proms: tuple[RulesPrometheus, RulesPrometheus]) -> None:
    one, many = proms
    diffs, compared, valued = [], 0, set()
    records = [r["record"] for r in recording_rules(GENERATED_RULES)]
    for back in INSTANTS_S:
        at = run.end + EVAL_INTERVAL_S - back
        for record in records:
            want, got = one.vector(record, at), many.vector(record, at)
            if want.keys() != got.keys():
                diffs.append((record, back, "series", sorted(want), sorted(got)))
                continue
            for labels, v in want.items():
                compared += 1
                if not math.isnan(v):
                    valued.add(record)
                if not agrees(record, v, got[labels]):
                    diffs.append((record, back, dict(labels), v, got[labels]))
    assert not diffs, diffs
    # the traffic exercised the rules: most cluster rules have a number, per-worker ones too
    cluster = {r for r in valued if r.startswith("cluster:")}
    assert len(cluster) >= 10, sorted(cluster)
    assert any(r.startswith("worker:") for r in valued), sorted(valued)
    assert compared > 200


# Series not pooled by a sum (tests.scale.shards_as_one): per-process gauges, top-K lists, a
# shard's part of per-worker values, what each shard received (every record, N times).
NOT_SUMMED = {
    "prefixscope_exporter_build_info", "prefixscope_signal_available", "prefixscope_worker_pool_size",
    "prefixscope_worker_pool_changes_total", "prefixscope_hot_branch_hit_tokens",
    "prefixscope_worker_effective_cache_value_tokens", "prefixscope_worker_removal_rank",
    "prefixscope_session_reshuffle_ratio", "prefixscope_records_ingested_total", "prefixscope_exporter_shards"}


def test_every_series_sums_over_the_shards_at_every_instant(run: Run, proms: tuple[RulesPrometheus, RulesPrometheus]) -> None:
    """In Prometheus, ``sum without (instance)`` of every counter, bucket and split gauge over the
    shards is the single exporter's all along the traffic: exactly for counts, to float rounding
    for sums of seconds and dollars."""
    one, many = proms
    names = sorted({key.split("{")[0] for key in run.one.series} - NOT_SUMMED)
    assert names == sorted({key.split("{")[0] for key in run.many.series} - NOT_SUMMED)
    diffs, compared = [], 0
    for back in range(0, int(run.end - run.start), 60):
        at = run.end - back
        for name in names:
            want = one.vector(f"sum without (instance) ({name})", at)
            got = many.vector(f"sum without (instance) ({name})", at)
            compared += len(want)
            diffs += [(name, back, dict(k), want.get(k), got.get(k)) for k in want.keys() | got.keys()
                      if k not in want or k not in got or not math.isclose(want[k], got[k], rel_tol=1e-12)]
    assert not diffs, diffs[:10]
    assert compared > 1000


class PinnedPrometheus(PrometheusClient):
    """The console's Prometheus client, reading at one instant (the end of the traffic) when the
    console reads "now": the two servers are read a few seconds apart, the history ended earlier."""

    def __init__(self, base_url: str, at: float) -> None:
        super().__init__(base_url, timeout=30)
        self.at = at

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        return super().query(expr, self.at if at is None else at)


def console_chain(url: str, at: float, limits: Limits, monkeypatch: pytest.MonkeyPatch) -> Chain:
    """``console.data.chain_from_prom``, the console's own reading, with its client pinned at ``at``."""
    with monkeypatch.context() as m:
        m.setattr(console_data, "prometheus", lambda u: PinnedPrometheus(u, at))
        console_data.chain_from_prom.clear()
        return console_data.chain_from_prom(url, limits)


def reading(chain: Chain) -> dict:
    checks = {k: (c.status, c.pending, c.missing) for k, c in chain.checks().items()}
    steps = {s.number: s.status for s in chain.steps}
    return {"checks": checks, "steps": steps, "verdict": chain.verdict.number if chain.verdict else None}


def test_the_console_reads_one_answer_from_the_shards_prometheus(
        run: Run, proms: tuple[RulesPrometheus, RulesPrometheus], monkeypatch: pytest.MonkeyPatch) -> None:
    at = run.end + EVAL_INTERVAL_S
    limits = limits_from_groups(run.groups)
    one = console_chain(proms[0].url, at, limits, monkeypatch)
    many = console_chain(proms[1].url, at, limits, monkeypatch)
    assert reading(many) == reading(one)
    for key, c in one.checks().items():
        got = many.checks()[key].value
        assert (got is None) == (c.value is None), key
        if c.value is not None:
            assert got is not None and agrees(c.check.value, c.value, got), (key, c.value, got)
    for field in ("available", "predicted", "achieved", "staleness"):
        a, b = getattr(one.reuse, field), getattr(many.reuse, field)
        assert (a is None) == (b is None) and (a is None or same(a, b, RATIO_TOL)), field
    valued = [k for k, c in one.checks().items() if c.value is not None]
    assert len(valued) >= 9, valued

    # the single exporter's own /api/v1/groups at the end of the traffic: the same verdict, the
    # same checks past their thresholds (its alert states come from its breach record, which this
    # test does not run: past the threshold reads "pending" there, as here without alert rules)
    exp = chain_from_exporter(run.groups)
    assert (exp.verdict.number if exp.verdict else None) == reading(one)["verdict"]
    past = {k for k, c in one.checks().items() if c.status == "firing" or c.pending}
    assert {k for k, c in exp.checks().items() if c.status == "firing" or c.pending} == past
    assert {k: c.missing for k, c in exp.checks().items()} == {k: c.missing for k, c in one.checks().items()}
    assert {s.number: s.status for s in exp.steps} == reading(one)["steps"]


# ---- a dead shard, live: real shard processes scraped by a real Prometheus -------------------------
# Three `prefixscope export` shard processes read the simulated workers' KV events from the relay's
# JetStream stream and scrape their home workers' /metrics; a live Prometheus scrapes the three
# every second and evaluates the rules `prefixscope generate` writes, from a threshold file with a
# 20 s window and short `for`s (the same generator; minutes of traffic would say the same slower).
# Worker w0 and w3 serve one long prompt over and over (their caches hit almost every block), w5
# a new prompt each time (no hits); w5's home shard is killed with SIGKILL.
LIVE_WORKERS = ("w0", "w3", "w5")  # home shards 0, 2 and 1 of 3 (exporter.core.sharding.home_shard)
COLD = "w5"
LIVE_WINDOW_S = 20
SHARD_FOR_S = 5
LIVE_TOL = 0.05  # the pooled hit rate moves this little while the traffic holds steady


def live_thresholds(path: Path) -> Path:
    data = yaml.safe_load((REPO / "alerts" / "thresholds.yaml").read_text(encoding="utf-8"))
    data["window"] = f"{LIVE_WINDOW_S}s"
    data["checks"]["exporter_shards"]["for"] = f"{SHARD_FOR_S}s"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


class LivePrometheus:
    """prometheus on 127.0.0.1 scraping ``targets`` every second with ``rules``, in cluster "e2e"."""

    def __init__(self, binary: str, targets: list[str], rules: Path, workdir: Path) -> None:
        self.workdir = workdir
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "prefixscope",
                                "static_configs": [{"targets": targets, "labels": {"cluster": "e2e"}}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        log = (workdir / "prometheus.log").open("a")
        self.proc = subprocess.Popen(
            [binary, "--config.file=prometheus.yml", "--storage.tsdb.path=data",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        wait_for(lambda: requests.get(f"{self.url}/-/ready", timeout=5).ok, "prometheus ready", timeout=120,
                 every=0.2, ignore=(requests.RequestException,))

    def query(self, expr: str, at: float | None = None) -> dict[tuple[tuple[str, str], ...], float]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        r = requests.get(f"{self.url}/api/v1/query", params=params, timeout=30)
        r.raise_for_status()
        return {tuple(sorted((k, v) for k, v in s["metric"].items() if k != "__name__")): float(s["value"][1])
                for s in r.json()["data"]["result"]}

    def one(self, expr: str, at: float | None = None) -> float | None:
        got = self.query(expr, at)
        assert len(got) <= 1, got
        return next(iter(got.values()), None)

    def alerts(self, name: str) -> list[dict]:
        r = requests.get(f"{self.url}/api/v1/alerts", timeout=30)
        r.raise_for_status()
        return [a for a in r.json()["data"]["alerts"] if a["labels"].get("alertname") == name]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LiveShard:
    """``prefixscope export`` as family shard ``index`` of 3: the stream, and its home workers' /metrics."""

    def __init__(self, workdir: Path, index: int, nats_url: str, workers: list[dict], thresholds: Path) -> None:
        self.index, self.port = index, free_port()
        self.cfg = workdir / f"shard{index}.yaml"
        self.cfg.write_text(yaml.safe_dump({
            "kv_nats": {"url": nats_url, "all_workers": True, "durable": f"live-shard{index}"},
            "shard": {"index": index, "count": 3},
            "workers": [{"name": w["name"], "metrics_url": w["url"] + "/metrics"} for w in workers],
            "scrape_interval": "1s", "scrape_timeout": "1s", "thresholds": str(thresholds),
            "records": {"http": {"enabled": False}}}))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "export", "--config.file", str(self.cfg),
                                      "--web.listen-address", f"127.0.0.1:{self.port}"], cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: requests.get(self.url + "/healthz", timeout=2).ok, f"shard {self.index} serving",
                 timeout=60, every=0.2, ignore=(requests.RequestException,))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def steady_traffic(fleet, stop: threading.Event) -> None:
    """The hot workers' one prompt again and again; the cold worker a new prompt each time."""
    hot = "[system] " + "you are a helpful assistant who answers briefly " * 24
    n = 0
    while not stop.is_set():
        for w in LIVE_WORKERS:
            prompt = hot if w != COLD else f"[{n}] " + " ".join(f"word{(n * 7 + i) % 9973}" for i in range(200))
            with contextlib.suppress(requests.RequestException):
                requests.post(fleet[w].url + "/v1/completions", timeout=10,
                              json={"model": "sim-model", "prompt": prompt, "max_tokens": 2})
        n += 1
        stop.wait(0.05)


def by_worker(vector: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    return {dict(k)["worker"]: v for k, v in vector.items()}


HIT = "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m"
RESIDENT = "worker:prefixscope_worker_resident_blocks_per_capacity:ratio"
UNGUARDED_HIT = (f"sum(rate(prefixscope_prefix_cache_hit_tokens_total[{LIVE_WINDOW_S}s])) / "
                 f"sum(rate(prefixscope_prefix_cache_queried_tokens_total[{LIVE_WINDOW_S}s]))")


def test_a_killed_shard_fires_its_alert_within_its_for_and_the_pooled_rules_go_empty_not_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamlit.testing.v1 import AppTest

    from alerts import rules as alert_rules
    from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
    from exporter.config import WorkerTarget
    from exporter.core.sharding import home_shard
    from exporter.relay import Relay, RelayConfig
    from fleet.engine import WorkerSpec
    from fleet.workers import FleetOptions, WorkerFleet
    from prefixscope.thresholds import load as load_thresholds_file
    from tests.console.test_pages import APP
    from tests.e2e.test_shards import Nats

    prometheus_bin, nats_bin = require_tool("prometheus"), require_tool("nats-server")
    assert {w: home_shard(w, 3) for w in LIVE_WORKERS} == {"w0": 0, "w3": 2, "w5": 1}
    dead = home_shard(COLD, 3)
    th_path = live_thresholds(tmp_path / "thresholds.yaml")
    th = load_thresholds_file(th_path)
    rules = tmp_path / "prefixscope.rules.yaml"
    rules.write_text(yaml.safe_dump(alert_rules.rule_groups(th, {c.alert: "" for c in catalog.CHECKS})))

    nats = Nats(nats_bin, tmp_path / "js")
    nats.start()
    fleet = WorkerFleet([WorkerSpec(w, block_size=16, num_gpu_blocks=64, max_running=4) for w in LIVE_WORKERS],
                        options=FleetOptions(delay_scale=0.0)).start()
    endpoints = fleet.endpoints()
    relay = Relay(RelayConfig(nats_url=nats.url, max_age_s=600, max_bytes=64 << 20, workers=tuple(
        WorkerTarget(e["name"], None, e["kv_endpoint"], e["replay_endpoint"], e["topic"]) for e in endpoints))).start()
    shards = [LiveShard(tmp_path, i, nats.url, endpoints, th_path) for i in range(3)]
    stop = threading.Event()
    traffic = threading.Thread(target=steady_traffic, args=(fleet, stop), daemon=True)
    prom: LivePrometheus | None = None
    try:
        assert relay.wait_started(20)
        for s in shards:
            s.start()
        traffic.start()
        prom = LivePrometheus(prometheus_bin, [s.url.removeprefix("http://") for s in shards], rules, tmp_path)

        # steady: every worker's hit rate and resident share, the pooled one in between
        def steady() -> float | None:
            per = by_worker(prom.query("worker:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m"))
            if set(per) != set(LIVE_WORKERS) or per[COLD] > 0.05 or min(v for w, v in per.items() if w != COLD) < 0.8:
                return None
            full = by_worker(prom.query(RESIDENT))
            if len(full) != 3 or full[COLD] < 0.9:  # the cold cache full: resident blocks hold still
                return None
            return prom.one(HIT)
        v0 = wait_for(steady, "steady hit rates and full caches", timeout=180, every=1.0)
        time.sleep(LIVE_WINDOW_S)  # the whole window at the steady rates
        v0 = prom.one(HIT)
        assert v0 is not None and 0.45 < v0 < 0.75, v0
        blocks0 = prom.one("sum(prefixscope_worker_resident_blocks)")
        assert blocks0
        assert prom.query('ALERTS{alertname="PrefixExporterShardDown"}') == {}

        killed_at = time.time()
        shards[dead].kill()

        def firing() -> dict | None:
            return next((a for a in prom.alerts("PrefixExporterShardDown") if a["state"] == "firing"), None)
        alert = wait_for(firing, "PrefixExporterShardDown firing", timeout=60, every=0.25)
        assert alert["labels"]["shard"] == str(dead) and alert["labels"]["cluster"] == "e2e"
        assert alert["labels"]["severity"] == "warning"
        # pending from the first failed scrape (a second's scrape and a second's evaluation), so it
        # fired `for` later: within its `for` of the kill, give or take those two intervals
        from prefixscope.units import parse_timestamp
        active = parse_timestamp(alert["activeAt"])
        assert active is not None and killed_at - 1.0 <= active <= killed_at + 3.0, (active - killed_at)

        # the survivors alone, once the dead shard's samples have left the window: what the rule
        # would have moved to (the survivors are the hot workers)
        time.sleep(max(0.0, killed_at + LIVE_WINDOW_S + 3 - time.time()))
        survivors = prom.one(UNGUARDED_HIT)
        assert survivors is not None and survivors - v0 > 0.15, (v0, survivors)
        # ... while the guarded rule, at every evaluation since the kill, kept its value or said nothing
        end = time.time()
        r = requests.get(f"{prom.url}/api/v1/query_range", timeout=30, params={
            "query": HIT, "start": f"{killed_at:.3f}", "end": f"{end:.3f}", "step": "0.5"}).json()["data"]["result"]
        after = [float(v) for s in r for _, v in s["values"]]
        assert all(abs(v - v0) <= LIVE_TOL for v in after), (v0, after)
        assert prom.one(HIT) is None and prom.query(RESIDENT) == {}
        # the workers' resident blocks summed over the two surviving shards: what the rule withholds
        partial = prom.one("sum(prefixscope_worker_resident_blocks)")
        assert partial is not None and partial < 0.95 * blocks0, (blocks0, partial)

        # the console: the cluster answer is partial, and the telemetry step is where it fires
        limits = limits_from_groups(requests.get(shards[0].url + "/api/v1/groups", timeout=10).json()["data"])
        chain = console_chain(prom.url, time.time(), limits, monkeypatch)
        assert chain.missing_shards == (str(dead),) and chain.shards_missing == 1
        assert chain.headline.state == "firing" and chain.headline.step.number == 0
        assert chain.checks()["prefix_hit_rate_total"].value is None  # withheld, not 0.8
        monkeypatch.setenv(PROMETHEUS_ENV, prom.url)
        monkeypatch.setenv(EXPORTER_ENV, shards[0].url)
        console_data.chain_from_prom.clear()
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception, at.exception
        assert any(w.value.startswith("**PARTIAL** · 1 of the exporter's family shards is not scraped "
                                      f'(shard="{dead}")') for w in at.warning), [w.value for w in at.warning]
        assert at.error[0].value.startswith("**FIRING** · Verdict: step 0 — Telemetry.")

        # back: it rebuilds from the stream, the alert resolves and the rule returns to the cluster's value
        shards[dead].start()
        wait_for(lambda: not prom.alerts("PrefixExporterShardDown"), "the alert resolved", timeout=60, every=0.5)
        back = wait_for(lambda: prom.one(HIT), "the pooled hit rate back", timeout=60, every=0.5)
        time.sleep(LIVE_WINDOW_S)  # a whole window of the restarted shard's counters
        back = prom.one(HIT)
        assert back is not None and abs(back - v0) <= LIVE_TOL, (v0, back)
        print(f"hit rate {v0:.3f} while all report, survivors alone {survivors:.3f}, back {back:.3f}; pending "
              f"{active - killed_at:+.1f}s after the kill; the rule's values since: {min(after, default=v0):.3f}–"
              f"{max(after, default=v0):.3f} ({len(after)} of them)")
    finally:
        stop.set()
        if prom is not None:
            prom.stop()
        for s in shards:
            s.stop()
        relay.close()
        fleet.stop()
        if nats.proc and nats.proc.poll() is None:
            nats.kill()
