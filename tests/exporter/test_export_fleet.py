"""The exporter against the simulated fleet: real HTTP scrapes, real ZMQ KV events, real record POSTs.

Workers run on the real clock with responses not delayed, so a test takes about a second.
Every check compares what the exporter exports with the workers' own truth (engine counters,
the cache's resident set) or with a recount from the records the test itself emitted.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import requests

from exporter.config import Config, HttpRecords, WorkerTarget
from exporter.main import Runtime
from fleet.engine import EngineResult, WorkerSpec
from fleet.records import HttpSink
from fleet.workers import FleetOptions, WorkerFleet
from tests.support import require_tool, wait_for

TOKEN = "fleet-token"
BLOCK = 16
MODEL = "sim-model"


@dataclass
class Cluster:
    fleet: WorkerFleet
    runtime: Runtime
    sink: HttpSink
    records: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.runtime.url

    def ask(self, worker: str, prompt: str, session: str | None = None, max_tokens: int = 2) -> dict:
        headers = {"x-session-key": session} if session else {}
        r = requests.post(self.fleet[worker].url + "/v1/completions", headers=headers, timeout=10,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
        r.raise_for_status()
        # One request at a time per worker: the cache outcome is then deterministic (requests in
        # flight together pin blocks and cannot reuse each other's).
        eng = self.fleet[worker].engine
        wait_for(lambda: eng.load() == (0, 0), what=f"{worker} idle")
        eng.tick()
        return r.json()

    def metric(self, name: str, **labels: str) -> float | None:
        text = requests.get(self.url + "/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            got_name, _, rest = series.partition("{")
            got_labels = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if got_name == name and got_labels == want:
                return float(value)
        return None


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_cluster(scrape=True) as c:
        yield c


@pytest.fixture
def unscraped_cluster() -> Iterator[Cluster]:
    """Workers known only from their records and KV events.

    A scrape that times out marks its worker down, and a session leaving a down worker is a
    migration, not a collision; on a loaded machine a 0.2 s scrape can time out at any moment.
    Tests that count collisions between healthy workers run without scrapes, so no such moment exists.
    """
    with running_cluster(scrape=False) as c:
        yield c


@contextmanager
def running_cluster(scrape: bool) -> Iterator[Cluster]:
    holder: dict[str, Cluster] = {}

    def on_request(result: EngineResult, headers: dict[str, str], _path: str) -> None:
        # What a gateway in front of the workers would emit: one prefixscope.request/v1 record.
        rec = {"ts": time.time(), "request_id": result.request_id, "worker": result.worker,
               "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
               "model": MODEL, "block_hashes": result.block_hashes, "block_size": BLOCK,
               "prefill_s": result.prefill_s, "queue_s": result.queue_s}
        if headers.get("x-session-key"):
            rec["session_key"] = headers["x-session-key"]
        c = holder["c"]
        with c.lock:
            c.records.append(rec)
        c.sink.emit(rec)

    specs = [WorkerSpec(name, block_size=BLOCK, num_gpu_blocks=48, max_running=4) for name in ("w0", "w1")]
    fleet = WorkerFleet(specs, options=FleetOptions(delay_scale=0.0), on_request=on_request).start()
    workers = tuple(WorkerTarget(e["name"], e["url"] + "/metrics" if scrape else None, e["kv_endpoint"],
                                 e["replay_endpoint"], e["topic"])
                    for e in fleet.endpoints())
    cfg = Config(source="test", workers=workers, scrape_interval=0.2, scrape_timeout=0.2,
                 listen_address="127.0.0.1:0", http_records=HttpRecords(bearer_token=TOKEN, max_body_bytes=65536))
    runtime = Runtime.build(cfg).start()
    assert runtime.subscriber is not None and runtime.subscriber.wait_connected(5)
    time.sleep(0.3)  # ZMQ subscriptions reach the PUB sockets asynchronously
    sink = HttpSink(runtime.url + "/api/v1/records", token=TOKEN, flush_interval_s=0.05, batch_size=50)
    holder["c"] = c = Cluster(fleet, runtime, sink)
    try:
        yield c
    finally:
        sink.close()
        runtime.stop()
        fleet.stop()


def settle(c: Cluster) -> None:
    """Wait until every engine's work is applied, every KV batch is published, every record is sent."""
    for w in c.fleet:
        if w.alive:
            w.engine.tick()
            wait_for(lambda w=w: w.engine.load() == (0, 0), what=f"{w.name} idle")
            w.engine.tick()
            w.publisher.flush(2.0)
    wait_for(lambda: c.sink.sent + c.sink.dropped == len(c.records), what="records delivered")
    assert c.sink.dropped == 0


def view_matches_cache(c: Cluster, worker: str) -> bool:
    truth = c.fleet[worker].engine.cache.resident()
    index = c.runtime.state.index
    with c.runtime.state.lock:
        return index.resident_blocks(worker) == len(truth) and all(index.holds(worker, h) for h in truth)


def prompt(tag: str, blocks: int) -> str:
    text = f"[{tag}] " + "lorem ipsum dolor sit amet " * 40
    return text[: blocks * BLOCK + 5]  # the 5 tokens of a partial tail are never cached


def test_hit_tokens_and_resident_blocks_match_the_workers_after_evictions(cluster: Cluster) -> None:
    c = cluster
    # Per worker: 6 prefixes of 9 blocks on a 48-block cache (evictions), then the 3 most recent
    # again (hits on what LRU kept).
    for i in [*range(6), 3, 4, 5]:
        for w in ("w0", "w1"):
            c.ask(w, prompt(f"{w}-doc{i}", 9))
    settle(c)

    def removed() -> float:
        applied = c.runtime.health.counter_value
        return sum(applied("prefixscope_kv_events_applied", (w, "BlockRemoved")) for w in ("w0", "w1"))

    wait_for(lambda: removed() > 0, what="evictions applied")
    for name in ("w0", "w1"):
        eng = c.fleet[name].engine
        wait_for(lambda name=name, eng=eng: c.metric("prefixscope_prefix_cache_hit_tokens_total",
                                                      worker=name, model=MODEL) == eng.counters.prefix_hits,
                 what=f"{name} hit tokens scraped")
        assert eng.counters.prefix_hits > 0
        assert c.metric("prefixscope_prefix_cache_queried_tokens_total", worker=name, model=MODEL) == eng.counters.prefix_queries
        wait_for(lambda name=name: view_matches_cache(c, name), what=f"{name} view == cache")
        assert c.metric("prefixscope_worker_resident_blocks", worker=name) == len(eng.cache.resident())
        assert c.metric("prefixscope_worker_capacity_blocks", worker=name) == 48


def test_session_metrics_equal_a_recount_from_the_records(unscraped_cluster: Cluster) -> None:
    c = unscraped_cluster
    # s-sticky stays on w0; s-moving alternates between the two healthy workers (collisions).
    for turn in range(4):
        c.ask("w0", prompt("sticky", 2 + turn), session="s-sticky")
        c.ask(f"w{turn % 2}", prompt("moving", 2 + turn), session="s-moving")
        c.ask("w1", prompt(f"once{turn}", 2))  # no session key: not part of session metrics
    settle(c)
    last: dict[str, str] = {}
    followups = collisions = prompt_tokens = cached_tokens = 0
    for rec in sorted(c.records, key=lambda r: r["ts"]):
        key = rec.get("session_key")
        if key is None:
            continue
        if key in last:
            followups += 1
            prompt_tokens += rec["prompt_tokens"]
            cached_tokens += rec["cached_tokens"]
            collisions += last[key] != rec["worker"]
        last[key] = rec["worker"]
    assert (followups, collisions) == (6, 3)
    wait_for(lambda: c.metric("prefixscope_followup_requests_total", model=MODEL) == followups, what="records ingested")
    assert c.metric("prefixscope_sticky_collisions_total", model=MODEL) == collisions
    assert c.metric("prefixscope_session_followup_prompt_tokens_total", model=MODEL) == prompt_tokens
    assert c.metric("prefixscope_session_followup_cached_tokens_total", model=MODEL) == cached_tokens
    assert c.metric("prefixscope_records_ingested_total", transport="http") == len(c.records)
    groups = requests.get(c.url + "/api/v1/groups", timeout=5).json()["data"]
    assert groups["signals"]["session_key"] is True and groups["signals"]["kv_events"] is True


def test_dropped_kv_batches_are_recovered_by_replay(cluster: Cluster) -> None:
    c = cluster
    w1 = c.fleet["w1"]
    c.ask("w1", prompt("before", 3))
    settle(c)
    w1.engine.knobs.drop_kv_events = 1.0  # the publisher numbers these batches but never sends them
    for i in range(3):
        c.ask("w1", prompt(f"dropped{i}", 3))
    settle(c)
    w1.engine.knobs.drop_kv_events = 0.0
    c.ask("w1", prompt("after", 3))  # the next batch reveals the gap
    settle(c)
    wait_for(lambda: view_matches_cache(c, "w1"), what="w1 view recovered")
    h = c.runtime.health
    assert h.counter_value("prefixscope_kv_event_sequence_gaps", ("w1",)) == 1
    assert h.counter_value("prefixscope_kv_event_missed_batches", ("w1",)) >= 3
    assert h.counter_value("prefixscope_kv_event_replays", ("w1", "recovered")) == 1
    assert h.counter_value("prefixscope_kv_event_replays", ("w1", "failed")) == 0


def test_worker_restart_clears_its_view(cluster: Cluster) -> None:
    c = cluster
    c.ask("w0", prompt("old", 6))
    c.ask("w1", prompt("other", 6))
    settle(c)
    wait_for(lambda: view_matches_cache(c, "w0"), what="w0 view")
    old = c.fleet["w0"].engine.cache.resident()
    assert old
    c.fleet.restart("w0")
    time.sleep(0.3)  # the subscriber's SUB socket reconnects to the new publisher
    c.ask("w0", prompt("new", 2))
    settle(c)
    wait_for(lambda: c.runtime.health.counter_value("prefixscope_worker_restarts", ("w0",)) == 1, what="restart seen")
    wait_for(lambda: view_matches_cache(c, "w0"), what="w0 view after restart")
    with c.runtime.state.lock:
        assert not any(c.runtime.state.index.holds("w0", h) for h in old)
    assert view_matches_cache(c, "w1")  # the other worker's view is untouched


def test_promtool_accepts_the_live_metrics(cluster: Cluster) -> None:
    promtool = require_tool("promtool")
    c = cluster
    for i in range(4):
        c.ask(f"w{i % 2}", prompt(f"p{i}", 4), session=f"s{i % 2}")
    settle(c)
    wait_for(lambda: c.metric("prefixscope_up", target="w0", kind="worker") == 1.0, what="scraped")
    text = requests.get(c.url + "/metrics", timeout=5).text
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_record_intake_errors_keep_the_valid_lines(cluster: Cluster) -> None:
    c = cluster
    url = c.url + "/api/v1/records"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    good = {"ts": time.time(), "request_id": "ok-1", "worker": "w0", "prompt_tokens": 32, "model": "other-model"}
    body = "\n".join([json.dumps(good), "{not json", json.dumps({"ts": 1, "worker": "w0"}),
                      json.dumps({**good, "request_id": "ok-2"}), "[1, 2]"]).encode()
    r = requests.post(url, data=body, headers=auth, timeout=5)
    assert r.status_code == 400  # some lines were bad: the sender must know, though the good ones are kept
    assert "2 record(s) accepted" in r.json()["error"]
    data = r.json()["data"]
    assert (data["accepted"], data["rejected"]) == (2, 3)
    assert [e["line"] for e in data["errors"]] == [2, 3, 5]
    assert "'request_id' is a required property" in data["errors"][1]["error"]
    wait_for(lambda: c.metric("prefixscope_request_prompt_tokens_total", model="other-model") == 64, what="valid kept")
    r = requests.post(url, data=b"{broken\n", headers=auth, timeout=5)
    assert r.status_code == 400 and r.json()["data"]["accepted"] == 0
    r = requests.post(url, data=body, headers={"Authorization": "Bearer nope"}, timeout=5)
    assert r.status_code == 401
    r = requests.post(url, data=(json.dumps(good) + "\n").encode() * 1000, headers=auth, timeout=5)
    assert r.status_code == 413 and r.json()["status"] == "error"
    assert c.metric("prefixscope_request_prompt_tokens_total", model="other-model") == 64  # nothing more taken
    assert c.metric("prefixscope_ingest_errors_total", source="records", kind="json") == 2
    assert c.metric("prefixscope_ingest_errors_total", source="records", kind="schema") == 1
    assert c.metric("prefixscope_ingest_errors_total", source="records", kind="not_object") == 1
