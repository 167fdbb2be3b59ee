"""The scale-out path on real parts: simulated vLLM workers (real ZMQ KV events) → relay → the real
nats-server's JetStream → one exporter, three family shards, and a real ``prefixscope export``.

One answer: the shards add up to the single exporter (resident blocks per worker, applied
events, "available" lookups), and both equal the workers' caches — after the relay and NATS
were each killed and restarted mid-run, and after one shard process was SIGKILLed mid-run and
restarted (it then equals the shard that never died). And the whole path into real Prometheus
servers with the generated rules: every recording rule, the console's chain and the single
exporter's /api/v1/groups agree between the three shards and the single exporter.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from exporter.bootstrap import bootstrap, build_nats_source
from exporter.config import Config, NatsKv, Shard, WorkerTarget
from exporter.core.checks import evaluate
from exporter.core.sharding import ShardRecords, ShardSink, ShardSpec, combined_match, owner_of_chain
from exporter.relay import Relay, RelayConfig
from exporter.sources.kv_nats import NatsKvSource
from exporter.web.collector import PrefixscopeCollector
from fleet.engine import EngineResult, WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet
from prefixscope.records import RequestRecord
from tests.scale.shards_as_one import ShardsAsOne, pooled_differences, samples
from tests.support import REPO, free_port, require_tool, wait_for

pytestmark = pytest.mark.slow

BLOCK = 16
WORKERS = ("w0", "w1", "w2", "w3")
SHARDS = 3


class Nats:
    """nats-server with JetStream on a fixed port and store, so a restart keeps both."""

    def __init__(self, binary: str, store: Path) -> None:
        self.binary, self.store, self.port = binary, store, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "-js", "-sd", str(self.store), "-p", str(self.port),
                                      "-a", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_for(up, what="nats-server listening")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)


@dataclass
class Exporter:
    state: object
    health: object
    source: NatsKvSource
    sink: ShardSink | None = None


def exporter(url: str, shard: Shard) -> Exporter:
    cfg = Config(source="test", kv_nats=NatsKv(url=url, all_workers=True), shard=shard)
    parts = bootstrap(cfg)
    source = build_nats_source(cfg, (), parts.state, parts.health)
    assert source is not None
    source.start()
    return Exporter(parts.state, parts.health, source, source.sink if shard.count > 1 else None)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[dict]:
    nats_bin = require_tool("nats-server")
    nats = Nats(nats_bin, tmp_path / "js")
    nats.start()
    chains: list[list[int]] = []
    specs = [WorkerSpec(n, block_size=BLOCK, num_gpu_blocks=40, max_running=4) for n in WORKERS]

    results: list[tuple[EngineResult, str | None]] = []

    def on_request(result: EngineResult, headers: dict[str, str], _path: str) -> None:
        chains.append(list(result.block_hashes))
        results.append((result, {k.lower(): v for k, v in headers.items()}.get("x-session-id")))

    fleet = WorkerFleet(specs, options=FleetOptions(delay_scale=0.0), on_request=on_request).start()
    targets = tuple(WorkerTarget(e["name"], None, e["kv_endpoint"], e["replay_endpoint"], e["topic"])
                    for e in fleet.endpoints())
    relay_cfg = RelayConfig(nats_url=nats.url, max_age_s=600, max_bytes=64 << 20, workers=targets)
    relay = Relay(relay_cfg).start()
    assert relay.wait_started(20)
    time.sleep(0.3)  # ZMQ subscriptions reach the PUB sockets asynchronously
    single = exporter(nats.url, Shard())
    shards = [exporter(nats.url, Shard(i, SHARDS)) for i in range(SHARDS)]
    rig = {"nats": nats, "fleet": fleet, "relay": relay, "relay_cfg": relay_cfg, "single": single,
           "shards": shards, "chains": chains, "results": results, "tmp": tmp_path}
    try:
        yield rig
    finally:
        for e in [single, *shards]:
            e.source.close()
        rig["relay"].close()
        fleet.stop()
        if nats.proc and nats.proc.poll() is None:
            nats.kill()


def traffic(fleet: WorkerFleet, tag: str, n: int = 24) -> None:
    """Prompts that share system prompts across workers and grow per conversation (evictions too)."""
    for i in range(n):
        w = WORKERS[i % len(WORKERS)]
        text = f"[system {i % 3}] " + "you are a helpful assistant " * 12 + f"[{tag} user {i}] " + "tell me more " * (5 + i % 7)
        r = requests.post(fleet[w].url + "/v1/completions", timeout=10, headers={"X-Session-Id": f"{tag}-{i % 6}"},
                          json={"model": "sim-model", "prompt": text, "max_tokens": 2})
        r.raise_for_status()


def settle(rig: dict) -> None:
    for w in rig["fleet"]:
        w.engine.tick()
        wait_for(lambda w=w: w.engine.load() == (0, 0), what=f"{w.name} idle")
        w.engine.tick()
        w.publisher.flush(2.0)
    wait_for(lambda: rig["relay"].pending == 0, what="relay drained", timeout=60)


def truth(rig: dict) -> dict[str, set[int]]:
    return {w.name: set(w.engine.cache.resident()) for w in rig["fleet"]}


def resident(e: Exporter) -> Counter[str]:
    with e.state.lock:
        return Counter({w: e.state.index.resident_blocks(w) or 0 for w in WORKERS})


def views_match(rig: dict) -> bool:
    want = Counter({w: len(hs) for w, hs in truth(rig).items()})
    total = sum((resident(s) for s in rig["shards"]), Counter())
    return +resident(rig["single"]) == +want and +total == +want


def applied(e: Exporter) -> Counter[tuple[str, ...]]:
    counters = e.health.snapshot()[0].get("prefixscope_kv_events_applied", {})
    return Counter({k: v for k, v in counters.items() if k[1] != "AllBlocksCleared"})


def assert_one_answer(rig: dict) -> None:
    wait_for(lambda: views_match(rig), what="single exporter and shards equal the workers' caches", timeout=60)
    single, shards = rig["single"], rig["shards"]
    for w, hs in truth(rig).items():
        assert all(single.state.index.holds(w, h) for h in hs)
    assert sum((applied(s) for s in shards), Counter()) == applied(single)
    router = shards[0].sink.router
    for chain in rig["chains"]:
        want = single.state.index.longest_match(chain)
        exact = combined_match([s.state.index for s in shards], chain)  # exact whatever families it crosses
        assert (exact.blocks, dict(exact.per_worker)) == (want.blocks, dict(want.per_worker))
        families = {router.family_of(h) for h in chain[:want.blocks]}
        if None not in families and len(families) > 1:
            # the documented bound (exporter.core.sharding): a block stored while its parent was
            # on no worker roots a family of its own; once that parent is back in another family
            # the chain crosses two, and its owner shard holds only the first part
            continue
        owner = owner_of_chain(router, chain)
        got = shards[owner].state.index.longest_match(chain) if owner is not None else None
        seen = (got.blocks, dict(got.per_worker)) if got else None
        assert seen == (want.blocks, dict(want.per_worker)) if got else want.blocks == 0, (
            f"chain {rig['chains'].index(chain)} ({len(chain)} blocks, first {chain[0]:#x}): owner shard {owner}, "
            f"its match {seen}, the single exporter's {(want.blocks, dict(want.per_worker))}; every shard's: "
            f"{[(m.blocks, dict(m.per_worker)) for m in (s.state.index.longest_match(chain) for s in shards)]}")
    # no gaps left unhealed: nothing missed anywhere
    for e in [single, *shards]:
        assert not e.health.snapshot()[0].get("prefixscope_kv_event_missed_batches", {}) or \
            sum(e.health.snapshot()[0]["prefixscope_kv_event_missed_batches"].values()) == 0


def test_shards_equal_one_exporter_through_relay_and_nats_restarts(rig: dict) -> None:
    fleet = rig["fleet"]
    for e in [rig["single"], *rig["shards"]]:
        assert e.source.wait_started(30)
    traffic(fleet, "a")
    settle(rig)
    assert_one_answer(rig)

    # the relay dies; workers keep caching; a new relay resumes after each worker's last seq
    rig["relay"].close()
    traffic(fleet, "b")
    settle_workers_only(rig)
    rig["relay"] = Relay(rig["relay_cfg"]).start()
    assert rig["relay"].wait_started(20)
    time.sleep(0.3)
    traffic(fleet, "c")  # every worker publishes again: the jump past the resume point is replayed
    settle(rig)
    assert_one_answer(rig)

    # NATS dies mid-traffic and comes back with its store: publishes are retried, consumers resume
    rig["nats"].kill()
    traffic(fleet, "d")
    settle_workers_only(rig)
    time.sleep(2.5)  # longer than a publish's timeout: the relay retries
    rig["nats"].start()
    settle(rig)
    assert_one_answer(rig)
    assert rig["relay"].retries > 0


def settle_workers_only(rig: dict) -> None:
    for w in rig["fleet"]:
        w.engine.tick()
        wait_for(lambda w=w: w.engine.load() == (0, 0), what=f"{w.name} idle")
        w.engine.tick()
        w.publisher.flush(2.0)


def test_a_real_export_process_reads_the_stream(rig: dict) -> None:
    """``prefixscope export`` with ``kv_nats`` serves the same resident blocks as the in-process exporter."""
    traffic(rig["fleet"], "x")
    settle(rig)
    wait_for(lambda: views_match(rig), what="in-process views", timeout=60)
    cfg = rig["tmp"] / "exporter.yaml"
    cfg.write_text(yaml.safe_dump({"kv_nats": {"url": rig["nats"].url, "all_workers": True, "durable": "proc"},
                                   "records": {"http": {"enabled": False}}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "export", "--config.file", str(cfg),
                             "--web.listen-address", f"127.0.0.1:{port}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        want = {w: len(hs) for w, hs in truth(rig).items()}

        def served() -> bool:
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except requests.RequestException:
                return False
            got = {}
            for line in text.splitlines():
                if line.startswith("prefixscope_worker_resident_blocks{"):
                    w = line.split('worker="')[1].split('"')[0]
                    got[w] = int(float(line.rsplit(" ", 1)[1]))
            return {w: n for w, n in got.items() if n} == {w: n for w, n in want.items() if n}
        wait_for(served, what="export process serves the workers' resident blocks", timeout=60)
    finally:
        proc.terminate()
        proc.wait(10)


# ---- a shard killed mid-run ----------------------------------------------------------------------
def metric_values(text: str, name: str) -> Counter[tuple[tuple[str, str], ...]]:
    """The samples of one metric family in an exposition, by their sorted labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Counter[tuple[tuple[str, str], ...]] = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.value:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def exposition(port: int) -> str | None:
    try:
        r = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    except requests.RequestException:
        return None
    return r.text if r.ok else None


class ShardProcess:
    """``prefixscope export`` as shard ``index`` of ``SHARDS``, reading the stream; killable with SIGKILL."""

    def __init__(self, rig: dict, index: int) -> None:
        self.cfg = rig["tmp"] / f"shard{index}.yaml"
        # its own durable: two processes pulling one durable consumer would split the stream between them
        self.cfg.write_text(yaml.safe_dump({"kv_nats": {"url": rig["nats"].url, "all_workers": True,
                                                        "durable": f"killable-shard{index}"},
                                            "shard": {"index": index, "count": SHARDS},
                                            "records": {"http": {"enabled": False}}}))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "export", "--config.file", str(self.cfg),
                                      "--web.listen-address", f"127.0.0.1:{self.port}"], cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: exposition(self.port), what="shard process serving /metrics", timeout=60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no shutdown, no final ack
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def shard_view(text: str) -> tuple[Counter, Counter]:
    """What must survive the kill: resident blocks per worker, and events applied per worker and type."""
    applied_ = Counter({k: v for k, v in metric_values(text, "prefixscope_kv_events_applied_total").items()
                        if dict(k).get("event") != "AllBlocksCleared"})
    return metric_values(text, "prefixscope_worker_resident_blocks"), applied_


def test_a_shard_killed_mid_run_loses_no_block_after_recovery(rig: dict) -> None:
    """Shard 1 as a real process, SIGKILLed while the workers store and evict, then restarted: it
    rebuilds from the stream (its durable consumer recreated from the first retained message) and
    then serves exactly the blocks and counters of the shard that never died — and with the other
    shards it still adds up to the single exporter."""
    fleet = rig["fleet"]
    for e in [rig["single"], *rig["shards"]]:
        assert e.source.wait_started(30)
    proc = ShardProcess(rig, 1)
    try:
        proc.start()
        traffic(fleet, "a")
        settle(rig)
        assert_one_answer(rig)

        during = threading.Thread(target=traffic, args=(fleet, "b", 40))
        during.start()
        wait_for(lambda: len(rig["chains"]) >= 24 + 10, what="traffic under way")
        proc.kill()  # mid-run: batches it fetched but had not acknowledged are redelivered to nobody
        during.join(60)
        traffic(fleet, "c")  # the stream moves on while the shard is down
        settle(rig)
        proc.start()
        traffic(fleet, "d")  # and after it is back
        settle(rig)
        assert_one_answer(rig)
        reference = rig["shards"][1]

        def recovered() -> bool:
            text = exposition(proc.port)
            if text is None:
                return False
            blocks, applied_ = shard_view(text)
            want_blocks = Counter({(("worker", w),): n for w, n in resident(reference).items() if n})
            want_applied = Counter({tuple(sorted({"worker": k[0], "event": k[1]}.items())): v
                                    for k, v in applied(reference).items() if v})
            return blocks == want_blocks and applied_ == want_applied
        wait_for(recovered, what="the restarted shard equals the shard that never died", timeout=60)
        # its API says whose part it answers (the console warns on it)
        groups = requests.get(f"http://127.0.0.1:{proc.port}/api/v1/groups", timeout=10).json()["data"]
        assert groups["shard"] == {"index": 1, "count": SHARDS}
    finally:
        proc.stop()

    # a second live process on shard 2's durable would split its stream: it says so
    twin = exporter(rig["nats"].url, Shard(2, SHARDS))
    try:
        wait_for(lambda: twin.health.snapshot()[0].get("prefixscope_ingest_errors", {}).get(("kv_events", "durable")),
                 what="the shared durable reported")
    finally:
        twin.source.close()


# ---- one answer beyond counters ------------------------------------------------------------------
# measured on each exporter's own clock as it received the batch: equal label sets, close values
WALL_CLOCK = frozenset({"prefixscope_kv_event_lag_seconds", "prefixscope_kv_event_last_timestamp_seconds",
                        "prefixscope_kv_block_eviction_age_seconds_sum"})


def records_of(rig: dict) -> list[RequestRecord]:
    """The fleet's requests as the router's records (session key, chain, cached tokens, timings)."""
    now = time.time()
    return [RequestRecord(ts=now, request_id=r.request_id, worker=r.worker, prompt_tokens=r.prompt_tokens,
                          session_key=key, block_hashes=tuple(r.block_hashes), cached_tokens=r.cached_tokens,
                          predicted_cached_tokens=r.cached_tokens, ttft_s=r.ttft_s, prefill_s=r.prefill_s,
                          queue_s=r.queue_s)
            for r, key in rig["results"]]


def test_shards_give_one_exporters_series_checks_and_verdict(rig: dict) -> None:
    """Every shard is sent every record and keeps those of its families: with the KV events from the
    stream, every series pooled over the shards (as the recording rules pool them) is the single
    exporter's, and so are the checks' values and statuses, the steps and the chain's verdict."""
    for e in [rig["single"], *rig["shards"]]:
        assert e.source.wait_started(30)
    for tag in ("a", "b", "c"):
        traffic(rig["fleet"], tag)
    settle(rig)
    assert_one_answer(rig)
    records = records_of(rig)
    now = time.time()
    rig["single"].state.ingest_records(records, now)
    for i, s in enumerate(rig["shards"]):
        ShardRecords(s.state, ShardSpec(i, SHARDS)).ingest_records(records, now)
    states = [s.state for s in rig["shards"]]
    assert sum(1 for s in states if s.store.window_counter("prefixscope_requests")) >= 2  # records split
    for st in [rig["single"].state, *states]:
        st.refresh_tree_stats()

    diffs, compared = pooled_differences(samples(PrefixscopeCollector(rig["single"].state, rig["single"].health)),
                                         [samples(PrefixscopeCollector(s.state, s.health)) for s in rig["shards"]],
                                         timed=WALL_CLOCK)
    assert not diffs and compared > 40
    one = evaluate(rig["single"].state)
    many = evaluate(ShardsAsOne(states))  # type: ignore[arg-type]
    for key, r in one.results.items():
        got = many.results[key]
        assert got.status == r.status, key
        assert (got.value is None) == (r.value is None), key
        if r.value is not None:
            # quantiles interpolate the same pooled buckets; ratios are sums over sums; staleness and
            # ingest lag are each process's clock against the batch's (each received it on its own)
            timed = {"kv_event_staleness": 5.0, "kv_ingest_lag": 1.0}
            assert math.isclose(got.value, r.value, rel_tol=1e-9, abs_tol=timed.get(key, 1e-12)), key
    assert many.step_status == one.step_status and many.verdict == one.verdict
    assert sum(1 for r in one.results.values() if r.value is not None) >= 8


# ---- the whole path into a real Prometheus -------------------------------------------------------
COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def page(e: Exporter, instance: str) -> dict[str, float]:
    """One scrape of an exporter's /metrics as Prometheus stores it (its own ``instance``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from exporter.codecs import promtext
    from lab.harness import series_key

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PrefixscopeCollector(e.state, e.health))
    parsed = promtext.parse(generate_latest(registry).decode())
    assert not parsed.errors, parsed.errors[:3]
    return {series_key(name, {**s.labels, "job": "prefixscope", "instance": instance}): s.value
            for name, samples in parsed.samples.items() if not name.endswith("_created") for s in samples}


def from_zero(history) -> None:
    """Counters as an exporter exporting every series at 0 from its start would show them: a part
    born later than the whole would otherwise be extrapolated differently by ``rate``."""
    for key, col in history.series.items():
        if key.split("{")[0].endswith(COUNTER_SUFFIXES):
            first = next(i for i, v in enumerate(col) if v is not None)
            col[:first] = [0.0] * first


def test_through_relay_nats_and_a_real_prometheus_the_shards_give_one_exporters_rules_and_chain(
        rig: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: the simulated workers' KV events through the relay and JetStream to one
    exporter and three family shards, the records sent to all, every exporter's /metrics scraped as
    the traffic goes, and two real Prometheus servers with the generated rules (one over the single
    exporter, one over the three shards): every recording rule, the console's chain from each, and
    the single exporter's /api/v1/groups agree."""
    from console.limits import limits_from_groups
    from console.links import GENERATED_RULES
    from exporter.web import api
    from lab.harness import ScrapeHistory
    from tests.e2e.rules_prometheus import EVAL_INTERVAL_S, RulesPrometheus, recording_rules
    from tests.e2e.test_shards_prometheus import agrees, console_chain, reading

    prometheus, promtool = require_tool("prometheus"), require_tool("promtool")
    single, shards = rig["single"], rig["shards"]
    for e in [single, *shards]:
        assert e.source.wait_started(30)
    start = float(math.floor(time.time()))
    one, many = ScrapeHistory(1.0), ScrapeHistory(1.0)

    def scrape() -> None:
        t = time.time() - start
        for e in [single, *shards]:
            e.state.refresh_tree_stats()
        one.add(t, page(single, "single"))
        many.add(t, {k: v for i, s in enumerate(shards) for k, v in page(s, f"shard{i}").items()})

    scrape()
    for tag in ("a", "b", "c"):
        traffic(rig["fleet"], tag)
        settle(rig)
        assert_one_answer(rig)
        time.sleep(1.0)
        scrape()
    records = records_of(rig)
    now = time.time()
    single.state.ingest_records(records, now)
    for i, s in enumerate(shards):
        ShardRecords(s.state, ShardSpec(i, SHARDS)).ingest_records(records, now)
    for _ in range(3):
        time.sleep(1.0)
        scrape()
    end = start + one.times[-1]
    for history in (one, many):
        from_zero(history)
    proms = [RulesPrometheus(prometheus, promtool, h, start, end, GENERATED_RULES, tmp_path / name)
             for name, h in (("single", one), ("shards", many))]
    try:
        at = end + EVAL_INTERVAL_S
        # measured on each process's own clock (ages of the last batch): seconds apart, not equal
        clocked = ("kv_event_last_timestamp", "kv_event_lag")
        diffs, valued = [], set()
        for record in (r["record"] for r in recording_rules(GENERATED_RULES)):
            want, got = proms[0].vector(record, at), proms[1].vector(record, at)
            if want.keys() != got.keys():
                diffs.append((record, "series", sorted(want), sorted(got)))
                continue
            for labels, v in want.items():
                if math.isnan(v):
                    continue
                valued.add(record)
                close = (abs(got[labels] - v) <= 5.0 if any(c in record for c in clocked)
                         else agrees(record, v, got[labels]))
                if not close:
                    diffs.append((record, dict(labels), v, got[labels]))
        assert not diffs, diffs
        assert len([r for r in valued if r.startswith("cluster:")]) >= 8, sorted(valued)

        limits = limits_from_groups(api.groups(single.state))  # the limits in force, as the console gets them
        chains = [console_chain(p.url, at, limits, monkeypatch) for p in proms]
        assert reading(chains[1]) == reading(chains[0])
        exp = chain_from_exporter_groups(api.groups(single.state))
        assert (exp.verdict.number if exp.verdict else None) == reading(chains[0])["verdict"]
        past = {k for k, c in chains[0].checks().items() if c.status == "firing" or c.pending}
        assert {k for k, c in exp.checks().items() if c.status == "firing" or c.pending} == past
        lit = [k for k, c in chains[0].checks().items() if c.value is not None]
        assert len(lit) >= 6, lit
        print(f"{len(valued)} rules with values agree; console: {len(lit)} checks with values, "
              f"verdict {reading(chains[0])['verdict']}, past threshold {sorted(past)}")
    finally:
        for p in proms:
            p.stop()


def chain_from_exporter_groups(groups: dict):
    from console.chain import chain_from_exporter

    return chain_from_exporter(groups)
