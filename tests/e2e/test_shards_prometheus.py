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

import dataclasses
import math
import re
import time
from collections.abc import Iterator

import pytest
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
from tests.support import require_file, require_tool

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
    start = float(math.floor(time.time() - SPAN_S))
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


def _reads(expr: str) -> str:
    """A rule's expression with the rules it reads written out (their windows and quantiles)."""
    return expr + "".join(_reads(r.expr) for n, r in catalog.RULES_BY_NAME.items()
                          if re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])", expr))


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
