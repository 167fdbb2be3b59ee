"""SimEngine: counters in vLLM's semantics, timing model, queueing, visibility, knobs."""

import pytest

from fleet.cache import Stored
from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, Pending, RequestError, SimEngine, WorkerSpec


def make(**kw):
    clock = VirtualClock()
    events = []
    spec = WorkerSpec(
        name="w0",
        prefill_tps=1000.0,
        decode_tps=100.0,
        prefill_overhead_s=0.0,
        attention_knee_tokens=1e12,
        **kw,
    )
    eng = SimEngine(spec, clock, lambda ev, ts: events.append((ts, ev)))
    return eng, clock, events


def run(eng, clock, rid, tokens, max_tokens=1, **kw):
    r = eng.execute(EngineRequest(rid, token_ids=tokens, max_tokens=max_tokens, **kw))
    clock.advance(r.e2e_s)
    eng.tick()
    return r


def test_hits_queries_and_last_token_rule_in_tokens():
    eng, clock, _ = make()
    p = list(range(1, 49))  # 48 tokens = 3 full blocks
    r1 = run(eng, clock, "a", p)
    assert (r1.prompt_tokens, r1.cached_tokens) == (48, 0)
    r2 = run(eng, clock, "b", p)  # fully cached: the last token is recomputed, so 2 blocks hit
    assert r2.cached_tokens == 32
    r3 = run(eng, clock, "c", [*p, 5, 6])  # 50 tokens: all 3 blocks hit
    assert r3.cached_tokens == 48
    c = eng.counters
    assert (c.prefix_queries, c.prefix_hits) == (48 + 48 + 50, 0 + 32 + 48)
    assert c.prompt_tokens == 146 and c.requests_success == {"length": 3}
    assert len(c.ttft) == 3 and len(c.e2e) == 3


def test_timing_model_prefill_from_uncached_tokens_and_decode():
    eng, clock, _ = make()
    r = run(eng, clock, "a", list(range(1, 101)), max_tokens=11)
    assert r.prefill_s == pytest.approx(100 / 1000)
    assert r.decode_s == pytest.approx(10 / 100)  # first token comes with the prefill
    assert r.ttft_s == pytest.approx(0.1) and r.e2e_s == pytest.approx(0.2)
    r2 = run(eng, clock, "b", list(range(1, 101)), max_tokens=1)
    assert r2.cached_tokens == 96 and r2.prefill_s == pytest.approx(4 / 1000)
    eng.knobs.prefill_slowdown = 3.0
    r3 = run(eng, clock, "c", list(range(1, 101)), max_tokens=1)
    assert r3.prefill_s == pytest.approx(3 * 4 / 1000)


def test_attention_term_makes_long_cold_prompts_superlinear():
    clock = VirtualClock()
    spec = WorkerSpec("slow", prefill_tps=1000.0, attention_knee_tokens=1000.0, prefill_overhead_s=0.0)
    eng = SimEngine(spec, clock)
    short = eng.execute(EngineRequest("s", token_ids=[1] * 100, max_tokens=1))
    long = eng.execute(EngineRequest("l", token_ids=[2] * 1000, max_tokens=1))
    assert short.prefill_s == pytest.approx(0.1 * (1 + 50 / 1000))
    assert long.prefill_s == pytest.approx(1.0 * (1 + 500 / 1000))
    assert long.prefill_s / short.prefill_s > 10


def test_queueing_when_slots_are_full_and_load():
    eng, clock, _ = make(max_running=2)
    a = eng.execute(EngineRequest("a", token_ids=[1] * 100, max_tokens=1))  # 0.1 s
    b = eng.execute(EngineRequest("b", token_ids=[2] * 200, max_tokens=1))  # 0.2 s
    c = eng.execute(EngineRequest("c", token_ids=[3] * 100, max_tokens=1))
    assert a.queue_s == b.queue_s == 0.0
    assert c.queue_s == pytest.approx(0.1)  # waits for a's slot
    assert c.ttft_s == pytest.approx(0.2)
    assert eng.load() == (2, 1)
    clock.advance(0.15)
    assert eng.load() == (2, 0)
    clock.advance(1.0)
    assert eng.load() == (0, 0)


def test_blocks_of_a_request_in_flight_are_not_reused_until_its_prefill_ends():
    eng, clock, events = make()
    p = list(range(1, 65))
    a = eng.execute(EngineRequest("a", token_ids=p, max_tokens=50))
    b = eng.execute(EngineRequest("b", token_ids=p, max_tokens=1))  # same time: no reuse
    assert b.cached_tokens == 0
    assert eng.lookup(a.block_hashes) == 0
    clock.advance(a.prefill_s)
    assert eng.lookup(a.block_hashes) == 4
    stored = [ev for _, evs in events for ev in evs if isinstance(ev, Stored)]
    assert len(stored) == 1 and stored[0].hashes == tuple(a.block_hashes)
    # b finishes its prefill too, but its blocks were already stored: no second BlockStored
    clock.advance(1.0)
    eng.tick()
    assert sum(isinstance(ev, Stored) for _, evs in events for ev in evs) == 1


def test_trace_replay_with_block_ids_and_remainder():
    eng, clock, events = make(block_size=512)
    r = eng.execute(EngineRequest("t1", block_hashes=[7, 8, 9], prompt_tokens=1100, max_tokens=2))
    assert r.block_hashes == [7, 8]  # 1100 tokens: two full blocks, the third holds the remainder
    clock.advance(r.e2e_s)
    r2 = eng.execute(EngineRequest("t2", block_hashes=[7, 8, 10], prompt_tokens=1300, max_tokens=2))
    assert r2.cached_tokens == 1024
    assert events[0][1] == [Stored((7, 8), None, (), 512)]


def test_speculative_decoding_counters_follow_the_acceptance_knob():
    eng, clock, _ = make(spec_tokens=4)
    eng.knobs.spec_acceptance = 1.0
    r = run(eng, clock, "a", [1] * 20, max_tokens=41)  # 40 decoded tokens, 5 per step
    assert (r.spec_drafts, r.spec_draft_tokens, r.spec_accepted_tokens) == (8, 32, 32)
    eng.knobs.spec_acceptance = 0.0
    r = run(eng, clock, "b", [2] * 20, max_tokens=41)
    assert (r.spec_drafts, r.spec_draft_tokens, r.spec_accepted_tokens) == (40, 160, 0)
    eng.knobs.spec_acceptance = 0.6
    r = run(eng, clock, "c", [3] * 20, max_tokens=2001)
    rate = r.spec_accepted_tokens / r.spec_draft_tokens
    assert 0.25 < rate < 0.5  # expected Σ 0.6^i / 4 for i=1..4 ≈ 0.33
    c = eng.counters
    assert c.spec_draft_tokens == 32 + 160 + r.spec_draft_tokens


def test_expert_signature_follows_prefix_and_misalignment_knob():
    eng, clock, _ = make()
    p = list(range(1, 65))
    s1 = run(eng, clock, "a", p).expert_signature
    s2 = run(eng, clock, "b", [*p, 9, 9]).expert_signature
    s3 = run(eng, clock, "c", [5, *p]).expert_signature
    assert s1 == s2 != s3
    eng.knobs.expert_misalignment = 1.0
    assert run(eng, clock, "d", p).expert_signature != s1


def test_affinity_admission_flag():
    eng, clock, _ = make()
    p = list(range(1, 65))
    assert not run(eng, clock, "a", p).admitted_by_affinity  # nothing cached yet
    assert run(eng, clock, "b", p).admitted_by_affinity
    eng.knobs.affinity_admission = False
    assert not run(eng, clock, "c", p).admitted_by_affinity


def test_reset_cache_emits_cleared_and_forgets_blocks():
    eng, clock, events = make()
    r = run(eng, clock, "a", list(range(1, 33)))
    eng.reset_cache()
    assert type(events[-1][1][0]).__name__ == "Cleared"
    assert eng.lookup(r.block_hashes) == 0


@pytest.mark.parametrize(
    "req",
    [
        EngineRequest("x", token_ids=[]),
        EngineRequest("x"),
        EngineRequest("x", block_hashes=[1], prompt_tokens=0),
        EngineRequest("x", token_ids=[1], max_tokens=0),
        EngineRequest("x", token_ids=[1] * 10, max_tokens=200_000),
        EngineRequest("x", token_ids=[1] * 40, block_hashes=[5, 6, 7]),  # 40 tokens are 2 full blocks
    ],
)
def test_bad_requests_raise_request_error(req):
    eng, _, _ = make()
    with pytest.raises(RequestError):
        eng.execute(req)
    assert eng.counters.prefix_queries == 0


# -- admission order in continuous batching ------------------------------------------------
P = list(range(1, 65))  # 4 full blocks, made resident before each scenario below


def near(x: float):
    return pytest.approx(x, abs=1e-6)  # times near 1.8e9 s carry ~1e-7 s of float error


def _queue_behind_busy(aging_s: float = 2.0, affinity: bool = True):
    """One slot, warm prefix P; at T a cold 100-token request takes the slot until T+0.1; at
    T+0.01 'older' arrives (1 block of P resident + 84 cold tokens), at T+0.02 'hot' (all of P
    resident + 16 tokens). Returns the engine, clock, T and the three submissions."""
    eng, clock, _events = make(max_running=1, admission_aging_s=aging_s)
    run(eng, clock, "warm", P)
    eng.knobs.affinity_admission = affinity
    t0 = clock.now()
    busy = eng.submit(EngineRequest("busy", token_ids=[7] * 100, max_tokens=1))
    clock.advance(0.01)
    older = eng.submit(EngineRequest("older", token_ids=[*P[:16], *range(1000, 1084)], max_tokens=1))
    clock.advance(0.01)
    hot = eng.submit(EngineRequest("hot", token_ids=[*P, *range(2000, 2016)], max_tokens=1))
    return eng, clock, t0, busy, older, hot


def test_submit_returns_a_result_when_a_slot_is_free_else_a_pending_handle():
    eng, clock, _t0, busy, older, hot = _queue_behind_busy()
    assert busy.queue_s == 0.0 and busy.prefill_s == near(0.1)
    assert isinstance(older, Pending) and isinstance(hot, Pending)
    assert not older.done and older.wait(0) is None
    assert eng.load() == (1, 2) and eng.waiting == 2
    admitted = []
    hot.add_done_callback(lambda r: admitted.append(r.request_id))
    older.add_done_callback(lambda r: admitted.append(r.request_id))
    clock.advance(1.0)
    eng.tick()
    assert admitted == ["hot", "older"] and older.done and hot.done
    assert eng.load() == (0, 0)


def test_affinity_admits_a_later_request_with_a_resident_prefix_ahead_of_an_earlier_colder_one():
    eng, clock, t0, _, older, hot = _queue_behind_busy()
    clock.advance(1.0)
    eng.tick()
    h, o = hot.result, older.result
    # at T+0.1 the slot frees: hot (4 resident blocks, last-token rule keeps all 4 of 5) beats older (1)
    assert h.arrival == near(t0 + 0.02) and h.queue_s == near(0.08)
    assert h.cached_tokens == 64 and h.prefill_s == near(16 / 1000)
    # older follows when hot ends at T+0.116, 0.106 s after its arrival
    assert o.queue_s == near(0.106) and o.cached_tokens == 16
    assert h.queue_s < o.queue_s
    assert h.admitted_by_affinity and o.admitted_by_affinity  # older: nothing earlier was waiting
    assert h.first_token_at == near(t0 + 0.116)


def test_aging_bound_admits_the_long_waiting_request_first():
    eng, clock, _t0, _, older, hot = _queue_behind_busy(aging_s=0.05)
    clock.advance(1.0)
    eng.tick()
    o, h = older.result, hot.result
    # at T+0.1 older has waited 0.09 s > 0.05 s: forced in, though hot has the longer prefix
    assert o.queue_s == near(0.09) and o.cached_tokens == 16
    assert not o.admitted_by_affinity  # forced by the bound, not chosen for its prefix
    # hot, alone in the queue when older ends at T+0.1+0.084, is admitted for its prefix
    assert h.queue_s == near(0.1 + 0.084 - 0.02)
    assert h.admitted_by_affinity


def test_knob_off_keeps_first_come_first_served_and_never_flags():
    eng, clock, _t0, _, older, hot = _queue_behind_busy(affinity=False)
    clock.advance(1.0)
    eng.tick()
    o, h = older.result, hot.result
    assert o.queue_s == near(0.09)
    assert h.queue_s == near(0.1 + 0.084 - 0.02)
    assert not o.admitted_by_affinity and not h.admitted_by_affinity


def test_a_queued_request_hits_blocks_computed_while_it_waited():
    eng, clock, events = make(max_running=1)
    a = eng.submit(EngineRequest("a", token_ids=P, max_tokens=1))  # cold: prefill 0.064 s
    clock.advance(0.01)
    b = eng.submit(EngineRequest("b", token_ids=[*P, *range(500, 516)], max_tokens=1))
    assert isinstance(b, Pending)
    clock.advance(0.1)
    eng.tick()
    r = b.result
    # a's blocks are stored at the end of its prefill, the instant its slot frees: b takes them
    assert r.queue_s == near(0.054) and r.cached_tokens == 64
    stored = [(ts, ev.hashes) for ts, evs in events for ev in evs if isinstance(ev, Stored)]
    assert stored[0] == (near(a.arrival + 0.064), tuple(a.block_hashes))
    assert stored[1][1] == (r.block_hashes[4],)  # only b's one new block is stored
    assert eng.counters.prefix_hits == 64


def test_execute_runs_the_schedule_ahead_until_admission_without_moving_the_clock():
    eng, clock, _ = make(max_running=1)
    t0 = clock.now()
    a = eng.execute(EngineRequest("a", token_ids=P, max_tokens=1))
    b = eng.execute(EngineRequest("b", token_ids=P, max_tokens=1))
    assert b.queue_s == near(a.prefill_s) and b.cached_tokens == 48  # a's blocks, last-token rule
    assert clock.now() == t0 and eng.load() == (1, 1)


def test_tokens_given_with_their_hashes_are_published_not_rehashed_and_kept_only_until_the_prefill_ends():
    eng, clock, events = make()
    toks = list(range(1, 41))  # 2 full blocks + 8 tokens
    r = eng.submit(EngineRequest("a", token_ids=toks, block_hashes=[101, 102], max_tokens=50,
                                 lora_name="legal-ft", lora_id=3))
    assert r.block_hashes == [101, 102] and r.prompt_tokens == 40
    assert eng.cache._allocs["a"].tokens is toks  # held while the prefill runs
    clock.advance(r.prefill_s)
    eng.tick()
    stored = [e for _, evs in events for e in evs if isinstance(e, Stored)]
    assert stored == [Stored((101, 102), None, tuple(toks[:32]), 16, "GPU", 3, "legal-ft")]
    assert eng.cache._allocs["a"].tokens is None  # published: decoding needs only the hashes
    clock.advance(r.decode_s)
    eng.tick()
    assert eng.cache._allocs == {}
