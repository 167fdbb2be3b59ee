"""KV-event truth and cache pressure, through the public interfaces: the fleet's vLLM-format
publisher over real ZMQ on 127.0.0.1, worker /metrics text, the exporter's checks and /metrics.

- a full cache is normal; pressure is thrash on a full cache;
- a gap the replay healed is counted and is not a step-0 failure; a loss nothing healed is, and
  the view is repaired (counted) and marked unreliable until a complete rebuild, a cache reset or
  a restart confirms it (a burst past the replay buffer ends exact or flagged);
- every stream's gap series exist at 0;
- a worker page with families but no samples yet is up with missing values.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.codecs.normalize import parse_worker
from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.index.eviction import EvictionTracker
from exporter.core.state import ClusterState
from exporter.model import BlockRemoved, BlockStored, RebuildRequests
from exporter.sources.kv_zmq import KvEndpoint, KvEventSubscriber
from exporter.sources.scrape import Scraper, ScrapeTarget
from exporter.web.collector import PrefixscopeCollector
from fleet.cache import Cleared, Removed, Stored
from fleet.kv_publisher import KvEventPublisher
from prefixscope.thresholds import load_thresholds
from tests.support import free_port, wait_for

CAPACITY = 64


def _vllm_page(num_gpu_blocks: int = CAPACITY, usage: float = 1.0, extra: str = "") -> str:
    return f"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 2.0
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{num_gpu_blocks}"}} 1.0
{extra}"""


class Fleet:
    """One worker's publisher and the exporter's subscriber feeding a real ClusterState."""

    def __init__(self, *, buffer_steps: int = 10000, replay: bool = True) -> None:
        self.health = Health()
        self.drop = False
        pub_ep = f"tcp://127.0.0.1:{free_port()}"
        replay_ep = f"tcp://127.0.0.1:{free_port()}" if replay else None
        # the state asks, the subscriber rebuilds: one request queue handed to both, as bootstrap does
        rebuilds = RebuildRequests(["w0"] if replay else [])
        self.state = ClusterState.build(self.health, load_thresholds(), rebuild_request=rebuilds)
        self.pub = KvEventPublisher(pub_ep, replay_ep, buffer_steps=buffer_steps,
                                    drop_share=lambda: 1.0 if self.drop else 0.0)
        self.sub = KvEventSubscriber({"w0": KvEndpoint(pub_ep, replay_ep)}, self.state, self.health,
                                     replay_timeout=0.5, poll_interval=0.02, rebuilds=rebuilds)
        self.sub.start()
        assert self.sub.wait_connected() and self.sub.wait_started()
        self.batches = 0

    def send(self, events: list, *, dropped: bool = False) -> None:
        self.drop = dropped
        self.pub.publish(events, time.time())
        assert self.pub.flush()
        self.drop = False
        self.batches += 1

    def settle(self) -> None:
        """Wait until the exporter has applied every batch (the first may race the subscription)."""
        def done() -> bool:
            got = self.health.counter_value("prefixscope_kv_event_batches", ("w0",))
            return got >= self.pub.sent and self.sub._replays == {}
        wait_for(done, "the exporter to apply every delivered batch")

    def scrape(self, page: str) -> None:
        snapshot, errors = parse_worker("w0", page)
        assert errors == []
        self.state.observe_worker(snapshot, time.time())

    def close(self) -> None:
        self.sub.close()
        self.pub.close()


@pytest.fixture()
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.close()


def _counters(health: Health) -> dict:
    return health.snapshot()[0]


def _exposition(state: ClusterState) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(state, state.health))
    return generate_latest(reg).decode()


def _fill(f: Fleet, n: int, start: int = 1000) -> None:
    """Store ``n`` unique one-block prompts (the cache's LRU needs no eviction yet)."""
    for i in range(n):
        f.send([Stored((start + i,), None, (), 16)])


# ---- cache pressure -----------------------------------------------------------------------------
def test_full_cache_in_steady_state_without_thrash_raises_no_capacity_alert(fleet: Fleet) -> None:
    f = fleet
    f.scrape(_vllm_page())
    _fill(f, CAPACITY)
    # steady state: every new prompt is unique and evicts the oldest block, which never comes back
    for i in range(CAPACITY, 3 * CAPACITY):
        f.send([Removed((1000 + i - CAPACITY,)), Stored((1000 + i,), None, (), 16)])
    f.settle()
    f.scrape(_vllm_page())
    assert f.state.index.resident_blocks("w0") == CAPACITY  # 100 % of num_gpu_blocks: normal
    result = evaluate(f.state).results["prefix_block_count_per_worker"]
    assert result.status == "ok" and result.value == 0.0
    text = _exposition(f.state)
    assert 'prefixscope_kv_blocks_evicted_total{worker="w0"} 128.0' in text
    assert 'prefixscope_kv_blocks_restored_after_eviction_total{worker="w0"} 0.0' in text
    assert "prefixscope_kv_block_eviction_age_seconds_bucket" in text  # sampled ages of the evicted
    assert evaluate(f.state).verdict is None


def test_thrash_on_a_full_cache_fires_the_capacity_alert(fleet: Fleet) -> None:
    f = fleet
    f.scrape(_vllm_page())
    _fill(f, CAPACITY)
    # a working set of 80 prompts cycles through a 64-block cache: each one was just evicted
    for i in range(CAPACITY, 3 * CAPACITY):
        f.send([Removed((1000 + (i - CAPACITY) % 80,)), Stored((1000 + i % 80,), None, (), 16)])
    f.settle()
    f.scrape(_vllm_page())
    ev = evaluate(f.state)
    result = ev.results["prefix_block_count_per_worker"]
    assert result.status == "firing" and result.value is not None and result.value > 0.5
    assert ev.verdict is not None and ev.verdict["step"] == 1


def test_thrash_on_a_cache_that_is_not_full_does_not_count() -> None:
    health = Health()
    state = ClusterState.build(health, load_thresholds())
    snapshot, _ = parse_worker("w0", _vllm_page(num_gpu_blocks=1000))
    state.observe_worker(snapshot, 100.0)
    from exporter.model import KvBatch
    for i in range(40):
        events = (BlockRemoved((i % 20,)),) if i >= 20 else ()
        state.apply_kv_batch(KvBatch("w0", i, 100.0 + i, (*events, BlockStored((i % 20,), None, 16))), 100.0 + i)
    assert evaluate(state).results["prefix_block_count_per_worker"].value == 0.0  # 20 of 1000 blocks


def test_eviction_memory_is_bounded_per_worker() -> None:
    tracker = EvictionTracker(window_s=300.0, memory=32, sample_every=1)
    for i in range(10_000):
        tracker.apply("w0", [BlockStored((i,), None, 16), BlockRemoved((i,))], float(i) / 100)
    recent, live = tracker.tracked("w0")
    assert recent <= 32 and live <= 32


@pytest.mark.parametrize("compiled", [False, True])
def test_thrash_reaches_past_a_large_cache_sized_from_its_capacity(compiled: bool) -> None:
    """A 100k-block LRU cache over a 170k-block working set read cyclically stores every block again
    about 70k evictions after evicting it, past the default ring's 4096 × 16: sized from its
    num_gpu_blocks (far sample 64, reach 262k) the tracker reads thrash ≈ 1 (within the stated
    1/√n, n ≈ 2700 here); unsized it reads almost none."""
    import random

    from exporter.core.index.eviction import far_sample
    make = EvictionTracker
    if compiled:
        make = pytest.importorskip("exporter.core.index._prefix_core").CompiledEvictionTracker
    cap, working = 100_000, 170_000
    rng = random.Random(7)
    blocks = [rng.getrandbits(64) for _ in range(working)]
    assert far_sample(cap, 4096, 16) == 64
    readings = []
    for sized in (True, False):
        tracker = make(window_s=300.0)
        if sized:
            tracker.size_for("w0", cap)
        stored = restored = 0
        for cycle in range(3):
            for start in range(0, working, 1000):
                run = blocks[start:start + 1000]
                # LRU over a cyclic read: each store evicts the block stored `cap` stores before it
                gone = tuple(blocks[(cycle * working + i - cap) % working] for i in range(start, start + len(run))
                             if cycle * working + i >= cap)
                out = tracker.apply("w0", [BlockRemoved(gone), BlockStored(tuple(run), None, 16)],
                                    cycle * 60.0 + start / working * 60.0)
                if cycle == 2:
                    stored, restored = stored + out.stored, restored + out.restored
        readings.append(restored / stored)
    assert readings[0] == pytest.approx(1.0, abs=0.06) and readings[1] < 0.1, readings


def test_evicted_before_reuse_uses_record_hits_and_branching() -> None:
    tracker = EvictionTracker(window_s=300.0, sample_every=1)
    tracker.apply("w0", [BlockStored((1, 2), None, 16), BlockStored((3,), None, 16), BlockStored((4,), None, 16)], 0.0)
    tracker.apply("w0", [BlockStored((5,), 1, 16)], 1.0)  # 1 now has children 2 and 5: shared
    tracker.hits("w0", [3])  # a request record says block 3 was served from cache
    out = tracker.apply("w0", [BlockRemoved((1,)), BlockRemoved((2,)), BlockRemoved((3,)), BlockRemoved((4,))], 10.0)
    # 1 (branched) and 3 (hit) were reused; 2 (1's first child only) and 4 were not
    assert sorted(out.ages) == [(10.0, False), (10.0, False), (10.0, True), (10.0, True)]


# ---- KV-stream truth ---------------------------------------------------------------------------------
def test_gap_series_exist_at_zero_on_a_stream_without_gaps(fleet: Fleet) -> None:
    f = fleet
    _fill(f, 3)
    f.settle()
    c = _counters(f.health)
    for name in ("kv_event_sequence_gaps", "kv_event_missed_batches", "kv_event_lost_batches"):
        assert c[f"prefixscope_{name}"] == {("w0",): 0.0}, name
    assert c["prefixscope_kv_event_replays"] == {("w0", r): 0.0 for r in ("recovered", "partial", "failed")}
    assert c["prefixscope_kv_index_repairs"] == {("w0", "lost_batches"): 0.0, ("w0", "over_capacity"): 0.0}
    text = _exposition(f.state)
    assert 'prefixscope_kv_event_sequence_gaps_total{worker="w0"} 0.0' in text
    assert 'prefixscope_kv_view_unreliable{worker="w0"} 0.0' in text
    assert evaluate(f.state).results["kv_event_gaps"].status == "ok"


def test_healed_gap_is_counted_and_step_0_stays_clear(fleet: Fleet) -> None:
    f = fleet
    _fill(f, 2)
    f.settle()
    for i in range(3):
        f.send([Stored((2000 + i,), None, (), 16)], dropped=True)
    f.send([Stored((3000,), None, (), 16)])
    wait_for(lambda: f.state.index.resident_blocks("w0") == 6, "the replay to heal the gap")
    f.settle()
    c = _counters(f.health)
    assert c["prefixscope_kv_event_missed_batches"] == {("w0",): 3.0}
    assert c["prefixscope_kv_event_replays"][("w0", "recovered")] == 1.0
    assert c["prefixscope_kv_event_lost_batches"] == {("w0",): 0.0}
    assert sum(c["prefixscope_kv_index_repairs"].values()) == 0.0
    ev = evaluate(f.state)
    assert ev.results["kv_event_gaps"].status == "ok"
    assert ev.step_status[0] != "firing"


def test_unhealed_loss_fails_step_0_and_the_view_is_repaired() -> None:
    f = Fleet(buffer_steps=2)  # the worker's replay buffer keeps only the last two batches
    try:
        _fill(f, 2)
        f.settle()
        for i in range(4):  # seq 2..5 dropped
            f.send([Stored((2000 + i,), None, (), 16)], dropped=True)
        f.send([Stored((3000,), None, (), 16)])  # seq 6 reveals the gap; the buffer holds 5 and 6
        wait_for(lambda: f.health.counter_value("prefixscope_kv_index_repairs", ("w0", "lost_batches")) == 1,
                 "the repair")
        f.settle()
        c = _counters(f.health)
        assert c["prefixscope_kv_event_lost_batches"] == {("w0",): 3.0}  # 2, 3, 4
        assert c["prefixscope_kv_event_replays"][("w0", "partial")] == 1.0
        # rebuilt from what the buffer still had (seq 5, 6 — seq 0 is long gone): the view holds
        # those blocks only and is unreliable until something confirms it
        assert {h for h in (1000, 1001, 2002, 2003, 3000) if f.state.index.holds("w0", h)} == {2003, 3000}
        assert f.health.gauges["prefixscope_kv_view_unreliable"][("w0",)] == 1.0
        ev = evaluate(f.state)
        assert ev.results["kv_event_gaps"].status == "firing"
        assert ev.verdict is not None and ev.verdict["step"] == 0
        # the cache turns over (as many blocks stored as its capacity): that confirms nothing
        f.scrape(_vllm_page(num_gpu_blocks=8))
        _fill(f, 8, start=5000)
        wait_for(lambda: f.state.index.holds("w0", 5007), "the last block")  # (settle counts replayed batches too)
        assert f.health.gauges["prefixscope_kv_view_unreliable"][("w0",)] == 1.0
        f.send([Cleared(), Stored((6000,), None, (), 16)])  # the worker resets its cache: known exactly
        wait_for(lambda: f.state.index.holds("w0", 6000), "the reset")
        assert f.health.gauges["prefixscope_kv_view_unreliable"][("w0",)] == 0.0
    finally:
        f.close()


def test_a_burst_past_the_replay_buffer_ends_exact_or_flagged() -> None:
    # Hot blocks cached early and hit all along are never announced again; a burst of more
    # batches than the worker's replay buffer holds is lost on the wire. The rebuild can only
    # refill from what the buffer still holds, so the hot blocks are missing from the view —
    # and however many blocks the worker stores afterwards, the view must stay flagged until
    # something confirms it (a complete rebuild, a cache reset, a restart).
    f = Fleet(buffer_steps=8)
    try:
        f.scrape(_vllm_page(num_gpu_blocks=16))
        hot = tuple(range(100, 104))
        f.send([Stored(hot, None, (), 16)])
        f.settle()
        for i in range(12):  # the burst: more batches than the buffer holds, all lost on the wire
            f.send([Stored((2000 + i,), 103, (), 16), Removed((2000 + i,))], dropped=True)
        f.send([Stored((3000,), 103, (), 16), Removed((3000,))])  # reveals the gap
        wait_for(lambda: f.health.counter_value("prefixscope_kv_index_repairs", ("w0", "lost_batches")) == 1,
                 "the repair")
        f.settle()
        assert f.health.counter_value("prefixscope_kv_event_lost_batches", ("w0",)) > 0
        # the cache turns over many times (cold prompts stored and evicted; the hot ones stay resident)
        for i in range(48):
            f.send([Stored((5000 + i,), 103, (), 16), Removed((5000 + i,))])
        f.send([Stored((6000,), 103, (), 16)])
        wait_for(lambda: f.state.index.holds("w0", 6000), "the last block")  # (settle counts replayed batches too)
        missing = [h for h in hot if not f.state.index.holds("w0", h)]
        assert not missing or 'prefixscope_kv_view_unreliable{worker="w0"} 1.0' in _exposition(f.state), missing
        # a reset of the worker's cache empties it: the view is exact again
        f.send([Cleared(), Stored((7000,), None, (), 16)])
        wait_for(lambda: f.state.index.holds("w0", 7000), "the reset")
        assert 'prefixscope_kv_view_unreliable{worker="w0"} 0.0' in _exposition(f.state)
        assert {h for h in (*hot, 7000) if f.state.index.holds("w0", h)} == {7000}
    finally:
        f.close()


def test_view_with_more_blocks_than_capacity_is_rebuilt_from_the_replay(fleet: Fleet) -> None:
    f = fleet
    _fill(f, 6)
    f.settle()
    f.state.index.apply("w0", [BlockStored(tuple(range(9000, 9010)), None, 16)])  # phantom blocks (lost removals)
    f.scrape(_vllm_page(num_gpu_blocks=8))  # 16 resident on an 8-block worker: impossible
    wait_for(lambda: f.health.counter_value("prefixscope_kv_index_repairs", ("w0", "over_capacity")) == 1,
             "the over-capacity repair")
    wait_for(lambda: f.state.index.resident_blocks("w0") == 6, "the rebuild")  # the replay had everything
    assert not f.state.index.holds("w0", 9000)
    assert f.health.gauges["prefixscope_kv_view_unreliable"][("w0",)] == 0.0
    assert evaluate(f.state).results["kv_event_gaps"].status == "firing"  # drift is a step-0 failure


# ---- engine side ---------------------------------------------------------------------------------
class _Page(BaseHTTPRequestHandler):
    body = b""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


def test_worker_with_families_but_no_samples_is_up_with_missing_values() -> None:
    _Page.body = (b"# HELP vllm:prefix_cache_queries_total Prefix cache queries.\n"
                  b"# TYPE vllm:prefix_cache_queries_total counter\n"
                  b"# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
                  b"# TYPE vllm:kv_cache_usage_perc gauge\n"
                  b"# HELP vllm:time_to_first_token_seconds TTFT.\n"
                  b"# TYPE vllm:time_to_first_token_seconds histogram\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    health = Health()
    state = ClusterState.build(health, load_thresholds())
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        [outcome] = Scraper([ScrapeTarget("w0", url, "worker")], state, health).scrape_once()
    finally:
        server.shutdown()
        server.server_close()
    assert outcome.up, outcome.error
    assert health.gauges["prefixscope_up"][("w0", "worker")] == 1.0
    assert "prefixscope_ingest_errors" not in health.counters
    snap = state.worker_pool.workers["w0"].snapshot
    assert snap is not None and snap.flavour == "vllm" and snap.prefix_queried_tokens is None
    assert snap.kv_usage_ratio is None


def test_external_and_tier_cache_hits_per_worker() -> None:
    page = _vllm_page(extra="""# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 400.0
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 96.0
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 320.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 64.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 32.0
""")
    health = Health()
    state = ClusterState.build(health, load_thresholds())
    for name, text in (("w0", page), ("w1", _vllm_page())):
        snapshot, errors = parse_worker(name, text)
        assert errors == []
        state.observe_worker(snapshot, 100.0)
    text = _exposition(state)
    assert 'prefixscope_external_prefix_cache_queried_tokens_total{model="m",worker="w0"} 400.0' in text
    assert 'prefixscope_external_prefix_cache_hit_tokens_total{model="m",worker="w0"} 96.0' in text
    assert 'prefixscope_prefix_cache_tier_hit_tokens_total{model="m",tier="host",worker="w0"} 64.0' in text
    assert 'prefixscope_prefix_cache_tier_hit_tokens_total{model="m",tier="disk",worker="w0"} 32.0' in text
    # w1's engine exports none of them: absent, not 0
    assert 'worker="w1"' not in "".join(line for line in text.splitlines(True)
                                         if "external_prefix_cache" in line or "tier_hit" in line)
