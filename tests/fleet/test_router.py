"""The reference router over real simulated engines on a virtual clock."""

from __future__ import annotations

import random

import pytest

from fleet.cache import Stored
from fleet.clock import VirtualClock
from fleet.engine import SimEngine
from fleet.fallback import FallbackLadder, LadderConfig
from fleet.hashing import chain_hashes
from fleet.records import ListSink
from fleet.router import BlockHolderIndex, Router, RouterConfig
from fleet.simulation import worker_spec
from fleet.topology import load_topology
from fleet.workloads import SimRequest

BS = 16


def _tokens(seed: int, n: int) -> list[int]:
    return [b + 1 for b in random.Random(seed).randbytes(n)]


def _req(rid: str, tokens: list[int], key: str | None, out: int = 50, **kw) -> SimRequest:
    return SimRequest(t=0.0, request_id=rid, session_key=key, conversation=key or rid, turn=1,
                      prompt_tokens=len(tokens), block_hashes=chain_hashes(tokens, BS), output_tokens=out,
                      segment="web", kind="chat", token_ids=tokens, **kw)


class Fleet:
    """A router with one real engine per default-topology worker, KV events wired to it."""

    def __init__(self, policy: str = "topology-aware", **cfg) -> None:
        self.topo = load_topology()
        self.clock = VirtualClock()
        self.sink = ListSink()
        self.engines = {w.name: SimEngine(worker_spec(self.topo, w), self.clock, on_events=self._cb(w.name))
                        for w in self.topo.workers}
        self.router = Router(self.topo, self.engines, self.clock, config=RouterConfig(policy=policy, **cfg),
                             sink=self.sink)
        self.stored: list[tuple[str, Stored]] = []  # (worker, event) of every BlockStored

    def _cb(self, name: str):
        def cb(events, ts):
            self.stored += [(name, e) for e in events if isinstance(e, Stored)]
            self.router.on_kv_events(name, events, ts)
        return cb

    def send(self, rid: str, tokens: list[int], key: str | None, gap_s: float = 30.0, out: int = 50, **kw) -> dict:
        self.clock.advance(gap_s)  # earlier requests finish and their blocks become visible
        for e in self.engines.values():
            e.tick()
        rec = self.router.route(_req(rid, tokens, key, out, **kw))
        assert rec is not None
        return rec


def test_prefix_index_walks_every_worker_in_one_pass() -> None:
    idx = BlockHolderIndex()
    idx.add("w0", [1, 2, 3, 4])
    idx.add("w1", [1, 2, 9])
    idx.add("w2", [5])
    assert idx.match([1, 2, 3, 4, 7]) == {"w0": 4, "w1": 2}
    assert idx.match([5, 6]) == {"w2": 1}
    assert idx.match([8, 1]) == {}
    idx.remove("w0", [3])
    assert idx.match([1, 2, 3, 4]) == {"w0": 2, "w1": 2}
    idx.clear("w1")
    assert idx.match([1, 2, 9]) == {"w0": 2}
    assert idx.blocks("w1") == 0


def test_prefix_tree_keeps_a_shared_prefix_group_on_one_worker() -> None:
    f = Fleet("prefix-tree")
    system = _tokens(7, 4000)  # 250 full blocks shared by every session
    recs = [f.send(f"r{i}", system + _tokens(100 + i, 200), f"s{i}") for i in range(12)]
    # the very first session is a cold miss: the warm pool takes it
    assert recs[0]["fallback_tier"] == "warm_pool" and recs[0]["cached_tokens"] == 0
    # the next one is not cold (the prefix is cached somewhere) and leaves the warm pool for
    # the main pool; from then on the whole group lands on that worker and reuses the prefix
    group = {r["worker"] for r in recs[1:]}
    assert len(group) == 1 and not f.topo.worker(group.pop()).warm_pool
    assert recs[1]["cached_tokens"] == 0 and all(r["cached_tokens"] == 4000 for r in recs[2:])


def test_sessions_stick_and_follow_ups_reuse_their_context() -> None:
    f = Fleet()
    ctx = _tokens(1, 3000)
    first = f.send("a1", ctx, "alice")
    follow = f.send("a2", ctx + _tokens(2, 300), "alice")
    assert follow["worker"] == first["worker"] and follow["decision"] == "sticky"
    assert follow["cached_tokens"] == 3000 // BS * BS == follow["predicted_cached_tokens"]


def test_topology_aware_keeps_a_session_in_its_nvlink_domain_when_its_worker_fails() -> None:
    f = Fleet()
    ctx = _tokens(3, 3000)
    first = f.send("b1", ctx, "bob")
    home = first["worker"]
    f.router.fail_worker(home)
    moved = f.send("b2", ctx + _tokens(4, 200), "bob")
    assert moved["worker"] != home
    assert f.topo.domain_of(moved["worker"]) == f.topo.domain_of(home)
    assert (moved["migrated_from"], moved["migration_kind"], moved["decision"]) == (home, "hard", "migrate")
    # even once the failed worker is back, the session stays where it moved
    f.router.restore_worker(home, restarted=True)
    again = f.send("b3", ctx + _tokens(4, 200) + _tokens(5, 100), "bob")
    assert again["worker"] == moved["worker"] and again["migrated_from"] is None


def test_a_drain_moves_the_session_soft_with_its_kv() -> None:
    f = Fleet()
    ctx = _tokens(5, 6400)  # 400 blocks
    home = f.send("c1", ctx, "carol")["worker"]
    f.router.drain_worker(home)
    rec = f.send("c2", ctx + _tokens(6, 100), "carol")
    assert rec["migration_kind"] == "soft" and rec["migrated_from"] == home
    assert rec["cached_tokens"] == 6400  # the moved blocks count as cached on the new worker
    assert rec["migrate_s"] == pytest.approx(f.topo.transfer_seconds(6400, home, rec["worker"]))
    # the imported blocks arrive with their tokens, as a KV connector's load would store them
    imported = next(e for w, e in f.stored if w == rec["worker"])
    assert imported.parent is None and len(imported.hashes) == 400 and imported.token_ids == tuple(ctx)


def test_the_engine_publishes_the_tokens_and_lora_of_what_the_router_sends() -> None:
    f = Fleet()
    ctx = _tokens(21, 100)  # 6 full blocks and 4 tokens
    rec = f.send("t1", ctx, "tia", lora_name="billing-v2", lora_id=1)
    f.clock.advance(30)
    f.engines[rec["worker"]].tick()
    (worker, ev), = f.stored
    assert worker == rec["worker"] and ev.hashes == tuple(rec["block_hashes"])
    assert ev.token_ids == tuple(ctx[:96]) and (ev.lora_name, ev.lora_id) == ("billing-v2", 1)


def test_lost_kv_events_make_the_belief_stale() -> None:
    f = Fleet()
    ctx = _tokens(8, 3200)
    home = f.send("d1", ctx, "dave")["worker"]
    eng = f.engines[home]
    eng.knobs.drop_kv_events = 1.0
    eng.reset_cache()  # the AllBlocksCleared event never reaches the router
    rec = f.send("d2", ctx + _tokens(9, 100), "dave")
    assert rec["predicted_cached_tokens"] == 3200 and rec["cached_tokens"] == 0
    # with the event delivered, the router knows: nothing predicted, nothing achieved
    eng.knobs.drop_kv_events = 0.0
    eng.reset_cache()
    rec = f.send("d3", ctx + _tokens(9, 100) + _tokens(10, 50), "dave")
    assert rec["predicted_cached_tokens"] == 0 and rec["cached_tokens"] == 0
    assert f.router.kv_events_dropped[home] >= 1


def test_walk_latency_is_measured_and_the_slow_walk_knob_adds_to_it() -> None:
    f = Fleet(walk_delay_s=0.008)
    rec = f.send("e1", _tokens(11, 1000), "erin")
    assert 0.008 <= rec["walk_s"] < 0.008 + 0.005


def test_stateless_policies_have_no_belief_and_no_walk() -> None:
    f = Fleet("hash-mod")
    rec = f.send("h1", _tokens(12, 1000), "hank")
    assert rec["decision"] == "hash" and rec["walk_s"] is None and rec["predicted_cached_tokens"] is None


def test_cold_new_sessions_go_to_the_warm_pool_and_follow_ups_stay() -> None:
    f = Fleet()
    ctx = _tokens(13, 2000)
    rec = f.send("f1", ctx, "frank")
    assert rec["fallback_tier"] == "warm_pool" and f.topo.worker(rec["worker"]).warm_pool
    follow = f.send("f2", ctx + _tokens(14, 100), "frank")
    assert follow["worker"] == rec["worker"] and follow["fallback_tier"] is None


def test_re_sticky_finds_the_worker_of_a_retitled_session() -> None:
    f = Fleet()
    ctx = _tokens(15, 2000)
    first = f.send("g1", ctx, "user42-thread7-ab12")
    # the title changed the key's tail and the new prompt shares nothing: re-sticky, not cold
    rec = f.send("g2", _tokens(16, 2000), "user42-thread7-ffff")
    assert rec["fallback_tier"] == "re_sticky" and rec["worker"] == first["worker"]


def test_long_prompt_short_answer_goes_async_and_queues_behind_the_last() -> None:
    f = Fleet(async_share=0.5)
    f.router.ladder = FallbackLadder(LadderConfig(async_slots=1))
    doc1, doc2 = _tokens(17, 12000), _tokens(18, 12000)
    r1 = f.send("x1", doc1, None, out=8)
    r2 = f.send("x2", doc2, None, gap_s=0.0, out=8)
    assert r1["fallback_tier"] == r2["fallback_tier"] == "async_prefill"
    job1 = r1["queue_s"] + r1["prefill_s"] / 0.5
    job2 = r2["queue_s"] + r2["prefill_s"] / 0.5
    assert r1["async_wait_s"] == pytest.approx(job1)
    assert r2["async_wait_s"] == pytest.approx(job1 + job2)  # one slot: x2 starts when x1 ends


def test_a_request_the_engine_refuses_is_counted_not_raised() -> None:
    f = Fleet()
    f.clock.advance(1)
    assert f.router.route(_req("big", _tokens(19, 140000), "ivy")) is None
    assert f.router.rejected == 1


def test_async_exit_condition_suspends_the_tier_after_user_abandonment() -> None:
    ladder = FallbackLadder(LadderConfig(min_samples=3, async_abandon_s=5.0, suspend_s=60.0))
    for i in range(3):
        ladder.observe(100.0 + i, "async_prefill", prompt_tokens=1000, cached_tokens=0, ttft_s=6, async_wait_s=6.0)
    assert not ladder.usable("async_prefill", 110.0)
    assert ladder.usable("async_prefill", 163.0)
    assert ladder.exits["async_prefill"] == 1


def test_re_sticky_exit_condition_and_warm_pool_activity() -> None:
    ladder = FallbackLadder(LadderConfig(min_samples=2, re_sticky_min_hit=0.1, ttft_target_s=2.0))
    ladder.observe(0.0, "re_sticky", prompt_tokens=1000, cached_tokens=50, ttft_s=0.5)
    assert ladder.usable("re_sticky", 0.0)
    ladder.observe(1.0, "re_sticky", prompt_tokens=1000, cached_tokens=50, ttft_s=0.5)
    assert not ladder.usable("re_sticky", 2.0)  # 5% hit ratio: no improvement, exit
    ladder.observe(2.0, "warm_pool", prompt_tokens=1000, cached_tokens=0, ttft_s=3.0)
    assert ladder.active(3.0)["warm_pool"]  # cluster TTFT p99 (3 s) above the 2 s target
    assert ladder.relaxed_key("abcdefgh") == "abcd"


def test_a_cold_prefill_past_the_ttft_limit_is_downgraded_to_the_small_model() -> None:
    f = Fleet(downgrade_workers=("w7",))
    # 48000 cold tokens on a 20k tokens/s worker: an estimated 2.4 s prefill, past the 2 s limit;
    # a 500-token answer is too long for the async lane
    rec = f.send("m1", _tokens(20, 48000), "mia", out=500)
    assert rec["fallback_tier"] == "model_downgrade"
    assert (rec["worker"], rec["model"]) == ("w7", f.topo.downgrade_model)
    small = f.send("m2", _tokens(21, 2000), "noah", out=500)  # a cheap miss stays on the main model
    assert small["model"] == f.topo.model and small["fallback_tier"] != "model_downgrade"


def test_model_downgrade_exits_past_its_share_of_traffic() -> None:
    ladder = FallbackLadder(LadderConfig(min_samples=10, downgrade_max_share=0.2))
    for i in range(8):
        ladder.observe(float(i), None, prompt_tokens=100, cached_tokens=90, ttft_s=0.1)
    for i in range(3):
        ladder.observe(10.0 + i, "model_downgrade", prompt_tokens=100, cached_tokens=0, ttft_s=0.5)
    assert not ladder.usable("model_downgrade", 13.0)  # 3 of 11 requests (27 %) > 20 %


def test_a_request_waiting_for_a_slot_is_recorded_at_admission_with_its_arrival_ts() -> None:
    f = Fleet()
    for e in f.engines.values():
        e.spec.max_running = 1
    a = f.send("a", _tokens(40, 320), "kay", out=200)  # holds its worker's only slot ~2.5 s
    arrival = f.clock.advance(0.5)
    assert f.router.route(_req("b", _tokens(41, 320), "kay", out=5)) is None  # sticky, waits
    assert f.router.waiting == 1 and f.router.deferred == 1
    assert f.router.load(a["worker"], arrival) == 2  # the waiting request counts as load
    assert [r["request_id"] for r in f.sink.records] == ["a"]
    f.clock.advance(0.1)
    c = f.router.route(_req("c", _tokens(42, 320), "other", out=5))  # another worker, at once
    assert c is not None and c["worker"] != a["worker"]
    f.clock.advance(10.0)
    for e in f.engines.values():
        e.tick()
    recs = {r["request_id"]: r for r in f.sink.records}
    assert [r["request_id"] for r in f.sink.records] == ["a", "c", "b"]  # b's record came last
    b = recs["b"]
    assert b["ts"] == round(arrival, 6) and b["worker"] == a["worker"]
    a_end = a["ts"] + a["ttft_s"] + f.engines[a["worker"]].counters.decode[0]
    assert b["queue_s"] == pytest.approx(a_end - arrival, abs=1e-5)
    assert f.router.waiting == 0 and f.router.load(a["worker"], f.clock.now()) == 0


def test_the_exporter_takes_records_slightly_out_of_ts_order() -> None:
    from exporter.core.health import Health
    from exporter.core.state import ClusterState
    from prefixscope.thresholds import load_thresholds

    f = Fleet()
    for e in f.engines.values():
        e.spec.max_running = 1
    for i in range(12):  # two sessions on their anchors: s0's long requests queue, s1's short ones do not
        f.clock.advance(0.2)
        f.router.route(_req(f"r{i}", _tokens(50 + i, 200), f"s{i % 2}", out=200 if i % 2 == 0 else 2))
    f.clock.advance(30.0)
    f.router.settle()
    recs = f.sink.records
    assert len(recs) == 12
    assert [r["ts"] for r in recs] != sorted(r["ts"] for r in recs)  # arrival order was broken
    states = []
    for batch in (recs, sorted(recs, key=lambda r: r["ts"])):
        st = ClusterState.build(Health(), load_thresholds(), f.topo, window_s=300)
        st.ingest_records([dict(r) for r in batch], f.clock.now())
        states.append(st)
    ooo, ordered = states
    for got, want in ((ooo.store.cum.counters, ordered.store.cum.counters), (ooo.store.win.sums, ordered.store.win.sums)):
        assert got.keys() == want.keys()
        for key, value in want.items():  # sums of floats in another order: equal up to rounding
            assert got[key] == (pytest.approx(value) if isinstance(value, float) else
                                {k: pytest.approx(v) for k, v in value.items()})
    assert ooo.time.now == ordered.time.now
    for st in states:  # windows still expire everything once the clock has moved on
        st.store.win.expire(ooo.time.now + 301)
        assert st.store.win.sums == {}


def test_a_failed_worker_sheds_the_load_of_its_waiting_requests() -> None:
    f = Fleet()
    for e in f.engines.values():
        e.spec.max_running = 1
    a = f.send("a", _tokens(60, 320), "kay", out=200)
    t = f.clock.advance(0.5)
    assert f.router.route(_req("b", _tokens(61, 320), "kay", out=5)) is None
    assert f.router.load(a["worker"], t) == 2
    f.router.fail_worker(a["worker"])
    assert f.router.load(a["worker"], t) == 1 and f.router.waiting == 0
    f.router.settle()  # the engine still runs what it had queued: the record is not lost
    assert [r["request_id"] for r in f.sink.records] == ["a", "b"]
    assert f.router.load(a["worker"], f.clock.now() + 60) == 0
