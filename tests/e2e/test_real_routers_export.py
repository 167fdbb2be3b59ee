"""Real sglang-router and vllm-router in front of simulated workers, observed through the exporter.

Per router: three simulated workers (vLLM /metrics, KV events over ZMQ, speculative decoding on),
the unmodified router from the `.routers` venv, and the exporter in-process with real HTTP
scrapes and real ZMQ subscriptions. Prefix groups go through the router; the test compares the
exporter's /metrics and /api/v1/groups with the workers' own counters and caches, checks that
every signal needing request records is said to be missing (never 0), then kills a worker and
watches the router and the exporter report it down.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from jsonschema import Draft202012Validator

from exporter.codecs import normalize
from exporter.config import DEFAULT_LISTEN, Config, HttpRecords
from exporter.main import Runtime
from fleet.engine import WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet
from prefixscope import catalog
from tests.e2e.router_stack import (
    COUNTERS,
    FED_BY_SPANS_AND_TOPOLOGY,
    FED_WITHOUT_RECORDS,
    MODEL,
    TOKEN,
    Stack,
    exported,
    open_stack,
    settle,
)
from tests.e2e.routers import ENDPOINT, KINDS, ask, drive
from tests.support import require_tool, wait_for

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
ACCESS_LOG_SCRIPT = REPO / "examples" / "records-from-access-log.py"
SCHEMA = REPO / "prefixscope" / "schemas" / "request.v1.json"
RULES = REPO / "alerts" / "generated" / "prefixscope.rules.yaml"
P = catalog.NAMESPACE
GROUPS, PER_GROUP = 4, 5

# Signals only request records can feed behind these two routers routing cache_aware: with routers and
# workers alone they must be missing (affinity outcomes and index health come from other routers' own
# series: the SGLang gateway's sticky branches, Dynamo's and the gateway's KV-event-fed index).
RECORD_SIGNALS = ("records", "session_key", "block_hashes", "cached_tokens", "predicted_cached_tokens",
                  "prefill_timing", "async_prefill", "walk_latency", "migrations", "expert_signature",
                  "affinity_admission", "affinity_outcomes", "router_index_health")
# Checks of those signals (sessions, collisions, migrations, cold prefill, walk latency,
# placement, MoE, affinity) and of the topology that no file provides here.
UNFED_CHECKS = tuple(c.key for c in catalog.CHECKS
                     if any(s in RECORD_SIGNALS or s in ("topology", "warm_pool") for s in c.signals))


# ---- pure: router worker labels become the configured worker names ----------------------------
def test_router_worker_urls_are_mapped_to_configured_names() -> None:
    names = normalize.worker_names_by_url([("w1", "http://127.0.0.1:8331/metrics"),
                                           ("w2", "HTTP://127.0.0.1:8332/metrics/"), ("w3", "http://127.0.0.1:8333")])
    snap, errors = normalize.parse_router("vr", (FIXTURES / "vllm_router_metrics.txt").read_text(), "auto", names)
    assert errors == []
    # vllm_router_policy_decisions_total in the fixture: 8331 → 10, 8332 → 90, 8333 → 20
    assert snap.decisions == {"w1": 10.0, "w2": 90.0, "w3": 20.0}
    assert snap.healthy == {"w1": 1.0, "w2": 1.0, "w3": 1.0}
    snap, _ = normalize.parse_router("sr", (FIXTURES / "sglang_router_metrics.txt").read_text(), "auto",
                                     {"http://127.0.0.1:8151": "a"})
    # smg_worker_cb_outcomes_total: 8151 → 60 is named, the two workers not configured keep their URL
    assert snap.decisions == {"a": 60.0, "http://127.0.0.1:8152": 63.0, "http://127.0.0.1:8153": 33.0}


# ---- the stack --------------------------------------------------------------------------------
@pytest.fixture(params=KINDS)
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    with open_stack(request.param, tmp_path) as s:
        yield s


# ---- the end-to-end test ------------------------------------------------------------------------
@pytest.mark.slow
def test_router_and_workers_feed_every_group_they_can(stack: Stack) -> None:
    s = stack
    placed, cached = drive(s.router.url, ENDPOINT[s.kind], groups=GROUPS, per_group=PER_GROUP)
    served = Counter(w for ws in placed.values() for w in ws)
    assert sum(served.values()) == GROUPS * PER_GROUP
    assert all(len(set(ws)) == 1 for ws in placed.values()), f"a prefix group was split: {placed}"
    settle(s)

    # per-worker router decisions = requests each worker served (from its own response header)
    for w in s.fleet:
        assert sum(w.engine.counters.requests_success.values()) == served[w.name]
        got = s.value(f"{P}_router_decisions_total", router=s.kind, worker=w.name)
        assert got == (served[w.name] or None), (w.name, got, served)
        assert s.value(f"{P}_router_worker_healthy", router=s.kind, worker=w.name) == 1.0

    outcomes = {o: s.value(f"{P}_router_prefix_outcomes_total", router=s.kind, outcome=o) for o in ("hit", "miss")}
    if s.kind == "vllm-router":
        assert outcomes["hit"] + outcomes["miss"] == GROUPS * PER_GROUP
        # every follow-up found its group's prefix in the router's tree; the first ones could not
        assert outcomes["miss"] >= 1 and outcomes["hit"] >= GROUPS * (PER_GROUP - 1)
    else:  # sglang-router exports no prefix-match outcome: absent, not zero
        assert outcomes == {"hit": None, "miss": None}
        assert f"{P}_router_prefix_outcomes" not in s.names()

    # group 1 from the workers' counters and KV events
    hits = sum(w.engine.counters.prefix_hits for w in s.fleet)
    queries = sum(w.engine.counters.prefix_queries for w in s.fleet)
    assert hits > 0 and sum(cached) <= hits
    for w in s.fleet:
        c = w.engine.counters
        for name, fld in COUNTERS.items():
            assert s.value(f"{P}_{name}_total", worker=w.name, model=MODEL) == getattr(c, fld), (w.name, name)
        assert s.value(f"{P}_worker_resident_blocks", worker=w.name) == len(w.engine.cache.resident())
        assert s.value(f"{P}_worker_capacity_blocks", worker=w.name) == 4096

    data = s.groups()
    checks = {c["key"]: c for st in data["steps"] for c in st["checks"]}
    status = {st["step"]: st["status"] for st in data["steps"]}
    hit_rate = checks["prefix_hit_rate_total"]
    assert hit_rate["value"] == pytest.approx(hits / queries)
    assert hit_rate["status"] == ("firing" if hits / queries < hit_rate["threshold"] else "ok")
    # cache pressure is thrash on a full cache: these caches are far from full and evict nothing
    assert max(len(w.engine.cache.resident()) for w in s.fleet) < 0.9 * 4096
    assert checks["prefix_block_count_per_worker"]["value"] == 0.0
    draft = sum(w.engine.counters.spec_draft_tokens for w in s.fleet)
    accepted = sum(w.engine.counters.spec_accepted_tokens for w in s.fleet)
    spec = checks["speculative_decoding_acceptance_rate"]
    assert draft > 0 and spec["value"] == pytest.approx(accepted / draft)
    assert spec["status"] == ("firing" if accepted / draft < spec["threshold"] else "ok")
    assert status[0] == "ok" and status[5] in ("ok", "firing")

    # what needs request records (or a topology) is said to be missing, never 0
    for sig in ("worker_metrics", "kv_events", "spec_decode", "router_metrics"):
        assert s.value(f"{P}_signal_available", signal=sig) == 1.0, sig
    for sig in RECORD_SIGNALS:
        assert s.value(f"{P}_signal_available", signal=sig) == 0.0, sig
        assert data["signals"][sig] is False
    for key in UNFED_CHECKS:
        assert checks[key]["status"] == "not_instrumented" and checks[key]["value"] is None, checks[key]
        assert checks[key]["missing_signals"], key
    assert status[2] == status[3] == status[4] == "not_instrumented"
    exported = s.names()
    for m in catalog.METRICS:
        if m.source in ("records", "topology"):
            assert not any(n == m.name or n.startswith(m.name + "_") for n in exported), m.name
    assert data["reuse"]["prompt_tokens"] is None

    assert s.value(f"{P}_worker_pool_size") == 3.0

    # kill the worker of group 0: the router marks it unhealthy, the exporter reports it down
    victim = placed[0][0]
    s.fleet.kill(victim)
    wait_for(lambda: s.value(f"{P}_router_worker_healthy", router=s.kind, worker=victim) == 0.0,
             f"{s.kind} to report {victim} unhealthy through the exporter")
    wait_for(lambda: s.value(f"{P}_up", target=victim, kind="worker") == 0.0, f"{victim} up=0")
    assert s.value(f"{P}_up", target=s.kind, kind="router") == 1.0
    # the worker the router reports down, under its configured name, leaves the healthy pool
    wait_for(lambda: s.value(f"{P}_worker_pool_size") == 2.0, "the healthy pool to shrink to 2")
    # group 0 moves to a surviving worker and every request still succeeds
    moved = [ask(s.router.url, ENDPOINT[s.kind], 0, i)[1] for i in range(PER_GROUP, PER_GROUP + 3)]
    assert victim not in moved
    data = s.groups()
    step0 = next(st for st in data["steps"] if st["step"] == 0)
    targets_up = next(c for c in step0["checks"] if c["key"] == "targets_up")
    # the dead worker left the pool (no traffic reached it after its scrapes began to fail): a
    # fleet event, not blind telemetry, so step 0 stays ok and does not take the verdict
    assert targets_up["value"] == 0.0 and targets_up["status"] == "ok"
    assert data["verdict"] is None or data["verdict"]["step"] != 0


# ---- request records from a gateway's access log ------------------------------------------------
def access_log(now: float) -> list[str]:
    """Two sessions behind two upstreams, then three lines the script must skip."""
    def entry(dt: float, rid: str, upstream: str | None, session: str, prompt: int, cached: int | None) -> str:
        usage: dict = {"prompt_tokens": prompt, "completion_tokens": 16}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now + dt)) + "Z"
        e = {"time": when, "request_id": rid, "session_id": session, "status": 200,
             "response": {"model": MODEL, "usage": usage}}
        if upstream is not None:
            e["upstream"] = upstream
        return json.dumps(e)

    return [
        entry(-10, "r1", "http://10.0.0.5:8000/", "s1", 100, 0),
        entry(-9, "r2", "10.0.0.5:8000", "s1", 120, 96),
        entry(-8, "r3", "http://10.0.0.6:8000", "s1", 150, 16),  # moved off a healthy worker: a collision
        entry(-7, "r4", "http://10.0.0.6:8000", "s2", 80, 0),
        entry(-6, "r5", "http://10.0.0.6:8000", "s2", 90, None),  # the log lacks the cached count
        "this is not JSON",
        entry(-5, "r6", None, "s2", 90, 0),
        entry(-4, "r7", "http://10.0.0.6:8000", "s2", 90, 91),
    ]


def run_access_log_script(log: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ACCESS_LOG_SCRIPT), str(log), "--worker-name", "10.0.0.5:8000=w0",
                           "--worker-name", "http://10.0.0.6:8000/=w1", *extra],
                          capture_output=True, text=True, timeout=30)


def test_access_log_becomes_schema_valid_records(tmp_path: Path) -> None:
    log = tmp_path / "access.json"
    now = time.time()
    log.write_text("\n".join(access_log(now)) + "\n")
    done = run_access_log_script(log)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    validator = Draft202012Validator(json.loads(SCHEMA.read_text()))
    for rec in records:
        assert list(validator.iter_errors(rec)) == [], rec
    assert [(r["request_id"], r["worker"]) for r in records] == [
        ("r1", "w0"), ("r2", "w0"), ("r3", "w1"), ("r4", "w1"), ("r5", "w1")]
    assert records[1]["cached_tokens"] == 96 and records[1]["prompt_tokens"] == 120
    assert records[1]["ts"] == float(int(now) - 9) and records[1]["session_key"] == "s1"
    assert "cached_tokens" not in records[4]  # absent stays absent, never 0
    assert "line 6: not JSON" in done.stderr and "line 7: no worker" in done.stderr
    assert "line 8: cached_tokens 91 > prompt_tokens 90" in done.stderr
    assert "5 records; skipped lines: bad_cached_tokens 1, missing_worker 1, not_json 1" in done.stderr


def test_access_log_records_feed_the_session_signals(tmp_path: Path) -> None:
    log = tmp_path / "access.json"
    log.write_text("\n".join(access_log(time.time())) + "\n")
    cfg = Config(source="e2e", listen_address="127.0.0.1:0", http_records=HttpRecords(bearer_token=TOKEN))
    runtime = Runtime.build(cfg).start()
    try:
        url = runtime.url + "/api/v1/records"
        assert run_access_log_script(log, "--url", url, "--token", "wrong").returncode == 1
        token_file = tmp_path / "records.token"
        token_file.write_text(TOKEN + "\n")
        done = run_access_log_script(log, "--url", url, "--token-file", str(token_file))
        assert done.returncode == 0, done.stderr
        assert "5 records, 5 accepted and 0 rejected by the exporter" in done.stderr
        got = exported(runtime.url)

        def v(name: str, **labels: str) -> float | None:
            return got.get((f"{P}_{name}", tuple(sorted(labels.items()))))

        assert v("records_ingested_total", transport="http") == 5
        # follow-ups: r2, r3 (s1) and r5 (s2); r5 carries no cached count, so no tokens from it
        assert v("followup_requests_total", model=MODEL) == 3
        assert v("sticky_collisions_total", model=MODEL) == 1
        assert v("session_followup_prompt_tokens_total", model=MODEL) == 120 + 150
        assert v("session_followup_cached_tokens_total", model=MODEL) == 96 + 16
        for sig in ("records", "session_key", "cached_tokens"):
            assert v("signal_available", signal=sig) == 1.0, sig
        for sig in ("block_hashes", "walk_latency", "prefill_timing", "worker_metrics"):
            assert v("signal_available", signal=sig) == 0.0, sig
        checks = {c["key"]: c for st in requests.get(runtime.url + "/api/v1/groups", timeout=5).json()["data"]["steps"]
                  for c in st["checks"]}
        assert checks["prefix_hit_rate_per_session"]["value"] == pytest.approx(112 / 270)
        assert checks["sticky_session_collision_rate"]["value"] == pytest.approx(1 / 3)
        assert checks["prefix_tree_walk_latency"]["status"] == "not_instrumented"
    finally:
        runtime.stop()


# ---- docs/routers.md agrees with the catalogue ----------------------------------------------------
def test_routers_doc_lists_every_check_with_what_feeds_it() -> None:
    """Each check's row says "fed" exactly when the stack of its column feeds all its signals: routers
    and workers alone, then with OTLP spans and a topology file (the e2e tests check both sets)."""
    rows = {}
    for line in (REPO / "docs" / "routers.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            for key in re.findall(r"`(\w+)`", cells[1]):
                rows[key] = cells[3:]
    assert set(rows) == {c.key for c in catalog.CHECKS}
    for c in catalog.CHECKS:
        for fed_signals, said in zip((FED_WITHOUT_RECORDS, FED_BY_SPANS_AND_TOPOLOGY), rows[c.key], strict=True):
            assert said.startswith("fed") == (set(c.signals) <= fed_signals), (c.key, said)


# ---- examples/prometheus.yml ----------------------------------------------------------------------
def test_example_prometheus_config_loads_the_generated_rules_and_scrapes_the_default_address() -> None:
    config = REPO / "examples" / "prometheus.yml"
    promtool = require_tool("promtool")
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in done.stdout
    raw = yaml.safe_load(config.read_text())
    assert [(config.parent / f).resolve() for f in raw["rule_files"]] == [RULES.resolve()]
    job = next(j for j in raw["scrape_configs"] if j["job_name"] == catalog.NAMESPACE)
    assert job["static_configs"][0]["targets"] == [DEFAULT_LISTEN]


# ---- a killed worker stops answering, also on open connections ------------------------------------
def test_killed_worker_drops_keep_alive_connections() -> None:
    """Routers and scrapers keep connections open; a dead worker must not answer on them."""
    with WorkerFleet([WorkerSpec("w0")], options=FleetOptions(delay_scale=0.0)) as fleet:
        session = requests.Session()
        url = fleet["w0"].url + "/health"
        assert session.get(url, timeout=5).status_code == 200
        fleet.kill("w0")
        with pytest.raises(requests.ConnectionError):
            session.get(url, timeout=5)
