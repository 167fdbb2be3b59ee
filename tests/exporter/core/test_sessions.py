"""The session table: turns, last worker, LRU and idle expiry, and re-key detection edge cases."""

from exporter.core.sessions import MAX_CHAIN, SessionTable

S = (1, 2)  # a two-block system prompt every conversation starts with


def test_turns_last_worker_and_previous_values():
    t = SessionTable()
    first = t.observe("a", 100.0, "w0", [*S, 10], "web", epoch=0)
    assert (first.turn, first.previous_worker, first.previous_ts, first.previous_epoch) == (1, None, None, None)
    second = t.observe("a", 110.0, "w1", [*S, 10, 11], None, epoch=1)
    assert (second.turn, second.previous_worker, second.previous_ts, second.previous_epoch) == (2, "w0", 100.0, 0)
    assert second.rekey_of is None  # only first turns can be re-keys
    # a late (out-of-order) request still counts as a turn but does not move last_ts back
    third = t.observe("a", 105.0, "w1", None, None, epoch=1)
    s = t.get("a")
    assert third.turn == 3 and third.previous_ts == 110.0
    assert (s.worker, s.first_ts, s.last_ts, s.segment, s.pool_epoch) == ("w1", 100.0, 110.0, "web", 1)
    assert s.chain_len == 4  # a request without a chain keeps the registered one
    assert s.first_chain_len == 3


def test_lru_bound_evicts_the_least_recently_used_and_forgets_its_chain():
    t = SessionTable(max_sessions=2)
    t.observe("a", 100.0, "w0", [*S, 10], None, 0)
    t.observe("b", 101.0, "w0", [*S, 20], None, 0)
    t.observe("a", 102.0, "w0", [*S, 10, 11], None, 0)  # touching a makes b the oldest
    t.observe("c", 103.0, "w0", [*S, 30], None, 0)
    assert len(t) == 2 and t.evicted == 1
    assert t.get("b") is None and t.get("a") is not None and t.get("c") is not None
    # b's chain left with it: a new key continuing b's conversation has no source to match
    assert t.observe("d", 104.0, "w0", [*S, 20, 21], None, 0).rekey_of is None


def test_expire_drops_idle_sessions_oldest_first():
    t = SessionTable()
    t.observe("a", 100.0, "w0", None, None, 0)
    t.observe("b", 200.0, "w0", None, None, 0)
    t.observe("c", 300.0, "w0", None, None, 0)
    t.observe("a", 350.0, "w0", None, None, 0)  # a is active again: LRU order is b, c, a
    t.expire(now=450.0, horizon_s=200.0)  # idle > 200 s: b (250 s); c is 150 s idle and stops the scan
    assert [s.key for s in t.sessions()] == ["c", "a"] and t.evicted == 1


def test_rekey_continues_a_whole_first_prompt_beyond_the_shared_prefix():
    t = SessionTable()
    t.observe("a", 100.0, "w0", [*S, 10], "web", 0)
    t.observe("b", 101.0, "w0", [*S, 20], "web", 0)  # unrelated: S is shared, depth 2
    assert t.shared_depth == 2
    t.observe("a", 102.0, "w0", [*S, 10, 11, 12], "web", 0)
    assert t.observe("c", 103.0, "w1", [*S, 10, 11, 12, 13], "web", 0).rekey_of == "a"
    # c registered a's chain as related: that is not unrelated sharing, the shared depth stays 2
    assert t.shared_depth == 2


def test_no_rekey_within_the_shared_prefix_or_on_a_partial_first_prompt():
    t = SessionTable()
    t.observe("a", 100.0, "w0", [*S, 10, 11], None, 0)  # first prompt: 4 blocks
    t.observe("b", 101.0, "w0", [*S, 20], None, 0)
    assert t.observe("c", 102.0, "w0", [*S, 99], None, 0).rekey_of is None  # only the system prompt
    # reaches a's block 10 (held by a alone) but not a's whole first prompt: a new conversation
    # that happens to open like a's, not a's continuation
    assert t.observe("d", 103.0, "w0", [*S, 10, 77], None, 0).rekey_of is None


def test_no_rekey_when_two_sessions_hold_the_prefix():
    t = SessionTable()
    t.observe("a", 100.0, "w0", [*S, 10], None, 0)
    t.observe("b", 101.0, "w0", [*S, 10], None, 0)  # same opening question: ambiguous source
    assert t.shared_depth == 3
    assert t.observe("c", 102.0, "w0", [*S, 10, 11], None, 0).rekey_of is None


def test_no_rekey_past_the_horizon_or_without_a_chain():
    def table() -> SessionTable:
        t = SessionTable(rekey_horizon_s=60.0)
        t.observe("a", 100.0, "w0", [*S, 10], None, 0)
        t.observe("b", 101.0, "w0", [*S, 20], None, 0)
        return t

    t = table()
    assert t.observe("c", 161.0, "w0", [*S, 10, 11], None, 0).rekey_of is None  # a idle 61 s > 60 s
    assert t.observe("d", 161.0, "w0", None, None, 0).rekey_of is None
    assert t.observe("e", 161.0, "w0", [], None, 0).rekey_of is None
    assert table().observe("f", 130.0, "w0", [*S, 20, 21], None, 0).rekey_of == "b"  # b idle 29 s


def test_shared_depth_only_grows_with_unrelated_sharing():
    t = SessionTable()
    t.observe("a", 100.0, "w0", [*S, 10], None, 0)
    t.observe("a", 101.0, "w0", [*S, 10, 11], None, 0)  # its own next turn shares with itself: no change
    assert t.shared_depth == 0
    t.observe("b", 102.0, "w0", [1, 30], None, 0)  # shares one block with a
    assert t.shared_depth == 1


def test_first_session_ever_cannot_be_a_rekey_of_itself_and_chains_are_bounded():
    t = SessionTable()
    long_chain = list(range(1000, 1000 + MAX_CHAIN + 50))
    assert t.observe("a", 100.0, "w0", long_chain, None, 0).rekey_of is None
    assert t.get("a").chain_len == MAX_CHAIN and t.get("a").first_chain_len == MAX_CHAIN
    # the same key again is a second turn, never a re-key
    assert t.observe("a", 101.0, "w0", long_chain, None, 0).turn == 2


class _TwoPass(SessionTable):
    """The reference: every registration unregisters the old anchors, then registers the new."""

    def _reregister(self, s, chain, depths, anchors, old):  # type: ignore[no-untyped-def]
        return False


def test_one_pass_reregistration_equals_the_two_passes():
    import random

    rng = random.Random(5)
    for trial in range(40):
        fast, ref = SessionTable(max_sessions=30), _TwoPass(max_sessions=30)
        prompts = [[rng.randrange(12) for _ in range(rng.randrange(1, 20))] for _ in range(15)]
        ts = 0.0
        for _ in range(300):
            ts += rng.random()
            key = f"s{rng.randrange(40)}"
            base = rng.choice(prompts)
            chain = None if rng.random() < 0.1 else base[:rng.randrange(1, len(base) + 1)] + (
                [rng.randrange(12) for _ in range(rng.randrange(3))] if rng.random() < 0.5 else [])
            worker = f"w{rng.randrange(3)}"
            a = fast.observe(key, ts, worker, chain, None, 0)
            b = ref.observe(key, ts, worker, chain, None, 0)
            assert (a.turn, a.previous_worker, a.rekey_of) == (b.turn, b.previous_worker, b.rekey_of), trial
            assert fast._held == ref._held and fast.shared_depth == ref.shared_depth, trial
            assert [(s.key, s.anchors, s.chain_len) for s in fast.sessions()] == \
                [(s.key, s.anchors, s.chain_len) for s in ref.sessions()], trial
