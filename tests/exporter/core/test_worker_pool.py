"""The worker pool and the hotspots history, on their own."""

from exporter.core.health import Health
from exporter.core.hotspots import MAX_CHAIN_KEPT, Hotspots, _blocks, branch_label
from exporter.core.index.prefix_index import PrefixIndex, TreeStats
from exporter.core.input_time import InputTime
from exporter.core.worker_pool import WorkerPool

UP = "prefixscope_up"


def pool() -> tuple[WorkerPool, InputTime, Health]:
    t, h = InputTime(), Health()
    return WorkerPool(h, t, health_recency_s=60.0), t, h


def test_growth_while_discovering_is_not_a_change_then_changes_count() -> None:
    p, t, _ = pool()
    t.advance(100.0)
    p.served("w0", 100.0)
    assert p.update(100.0) is False and p.pool == {"w0"}
    t.advance(130.0)
    p.served("w1", 130.0)
    assert p.update(130.0) is False and p.epoch == 0  # still discovering (< 60 s after the first input)
    t.advance(170.0)
    p.served("w1", 170.0)
    assert p.update(170.0) is True  # w0 aged out: a pool change
    assert p.pool == {"w1"} and p.epoch == 1 and (p.changes[-1].before, p.changes[-1].after) == (2, 1)


def test_down_worker_with_no_traffic_left_the_pool_one_with_traffic_blinds() -> None:
    p, t, h = pool()
    t.advance(100.0)
    p.served("w0", 100.0)
    p.served("w1", 100.0)
    h.set(UP, ("w0", "worker"), 0.0)
    h.set(UP, ("w1", "worker"), 0.0)
    t.advance(110.0)
    p.track_down_targets()
    p.served("w1", 120.0)  # traffic still reaches w1
    assert p.left_pool("w0", "worker") and not p.left_pool("w1", "worker")
    assert p.blind_targets() == 1 and p.left_pool_targets() == [("w0", "worker")]
    assert not p.is_healthy("w0") and "w0" in p.explicitly_down()


def test_without_traffic_sources_a_down_worker_blinds_only_for_the_grace() -> None:
    """A minimal deployment (engine /metrics only): nothing says whether a down worker still serves,
    so it counts as blind — until it has been down for ``down_grace_s``: then it has left."""
    p, t, h = pool()
    p.down_grace_s = 600.0
    t.advance(100.0)
    p.worker("w0", 100.0)
    h.set(UP, ("w0", "worker"), 0.0)
    h.set(UP, ("r", "router"), 0.0)
    p.track_down_targets()
    t.advance(699.0)
    assert p.blind_targets() == 2 and p.liveness("w0") == "down"
    t.advance(700.0)
    assert p.blind_targets() == 1 and p.liveness("w0") == "left"  # the router still blinds us


def test_a_departed_worker_is_out_of_the_pool_and_never_blind() -> None:
    p, t, h = pool()
    t.advance(100.0)
    for w in ("w0", "w1"):
        p.worker(w, 100.0)
        h.set(UP, (w, "worker"), 1.0)
    p.update(100.0)
    h.set(UP, ("w1", "worker"), 0.0)
    p.track_down_targets()
    assert p.blind_targets() == 1
    p.depart("w1", 101.0)
    assert p.blind_targets() == 0 and p.liveness("w1") == "left"
    p.worker("w1", 102.0)  # a late scrape of it is no sign of membership
    # Announced by discovery: a pool change even while the exporter still finds its workers.
    assert p.update(102.0) is True and p.pool == {"w0"} and p.epoch == 1
    h.remove(UP, ("w1", "worker"))
    p.track_down_targets()
    assert ("w1", "worker") not in p.down_since
    p.rejoin("w1")
    assert p.is_healthy("w1")


def test_an_hour_of_hits_costs_little_memory_and_repeated_chains_share_one_copy() -> None:
    """An hour of hits at a busy cluster's rate used to cost ~2.6 KB each (64 Python ints a chain)."""
    import tracemalloc

    hs = Hotspots(PrefixIndex())
    sessions = [f"s{i}" for i in range(2000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):  # 2,000 conversations of 10 turns: each turn's leading blocks repeat
            conv = i % 2000
            chain = [conv * 1000 + b for b in range(MAX_CHAIN_KEPT + 10)]
            hs.hit(float(i), chain, MAX_CHAIN_KEPT + 10, 1024.0, sessions[conv])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held / 20_000 < 250, f"{held / 20_000:.0f} B a hit"
    assert len({id(e[1]) for e in hs.hit_events}) == 2000  # one copy per distinct chain
    # a chain with a value outside 64 bits is kept as it came
    hs.hit(1.0, [-1, 2], 2, 1.0, None)
    assert list(_blocks(hs.hit_events[-1][1])) == [-1, 2]


def test_hotspots_rank_branches_and_forget_after_an_hour() -> None:
    hs = Hotspots(PrefixIndex())
    stats = TreeStats(version=-1)  # no branching known: a chain's branch is its first block
    hs.hit(100.0, [1, 2, 3], 2, 32.0, "s1")
    hs.hit(110.0, [1, 9], 1, 16.0, "s2")
    hs.hit(120.0, [5], 1, 40.0, None)
    assert hs.hot_branches(5, 0.0, 200.0, stats) == [(1, 48.0, 2), (5, 40.0, 0)]
    assert list(_blocks(hs.hit_events[0][1])) == [1, 2]  # only the hit blocks of the chain are kept
    assert branch_label(1) == "00000000"
    hs.new_session(100.0, "web", False)
    hs.expire(3700.0)
    assert list(hs.session_events) == [] and [e[0] for e in hs.hit_events] == [110.0, 120.0]


def test_the_hit_history_keeps_at_most_its_configured_number_of_hits(tmp_path) -> None:
    from exporter.config import load_config
    from exporter.main import Runtime

    hs = Hotspots(PrefixIndex(), max_events=3)
    for i in range(5):
        hs.hit(float(i), [i], 1, 16.0, f"s{i}")
    assert [e[0] for e in hs.hit_events] == [2.0, 3.0, 4.0]
    cfg = tmp_path / "exporter.yaml"
    cfg.write_text("limits: {hit_history: 1234}\n")
    rt = Runtime.build(load_config(cfg).with_overrides(listen_address="127.0.0.1:0"))
    try:
        assert rt.state.hotspots.hit_events.maxlen == 1234
    finally:
        rt.server.httpd.server_close()


def test_noting_one_workers_evidence_keeps_the_pool_a_full_update_would() -> None:
    """``note`` touches only the worker that sent evidence while nothing else can have changed;
    over random scrapes, failures and silences it ends every step where ``update`` does."""
    import random

    rng = random.Random(5)
    a, ta, ha = pool()
    b, tb, hb = pool()
    ts = 1000.0
    names = [f"w{i}" for i in range(30)]
    full_updates = 0
    real_update = a.update

    def counted(ts: float) -> bool:
        nonlocal full_updates
        full_updates += 1
        return real_update(ts)

    a.update = counted  # type: ignore[method-assign]
    for step in range(3000):
        ts += rng.choice((0.0, 0.1, 1.0, 5.0))
        name = rng.choice(names[:10] if rng.random() < 0.8 else names)
        if rng.random() < 0.02:  # a target's up gauge flips (a failing or recovering scrape)
            up = rng.choice((0.0, 1.0))
            ha.set(UP, (name, "worker"), up)
            hb.set(UP, (name, "worker"), up)
            continue
        for p, t in ((a, ta), (b, tb)):
            t.advance(ts)
            p.worker(name, ts)
        changed_a, changed_b = a.note(name, ts), b.update(ts)
        assert (changed_a, a.pool, a.epoch) == (changed_b, b.pool, b.epoch), step
        assert a.down_since == b.down_since
    assert full_updates < 3000 / 3  # most scrapes changed nothing the worker itself did not


def test_the_down_and_left_sets_kept_on_change_are_the_ones_found_from_scratch() -> None:
    """The pool keeps which targets are down, since when, and which down workers left the pool as
    their inputs change, and judges only the workers whose evidence or state changed. Over random
    scrape failures and recoveries, router health, records, silences, departures and returns, each
    is what a walk over every gauge, router and worker finds at that moment."""
    import random

    from exporter.model import RouterSnapshot

    rng = random.Random(11)
    p, t, h = pool()
    p.down_grace_s = 40.0
    names = [f"w{i}" for i in range(25)]
    routers = ("r0", "r1")
    decisions = {r: dict.fromkeys(names, 0.0) for r in routers}
    since: dict[tuple[str, str], float] = {}  # the reference's own record of failing targets
    ts = 1000.0
    for step in range(4000):
        ts += rng.choice((0.0, 0.1, 1.0, 2.0, 5.0)) if rng.random() < 0.99 else 70.0  # now and then all age
        t.advance(ts)
        name = rng.choice(names)
        roll = rng.random()
        if roll < 0.15:  # a scrape fails or recovers, or a target goes away
            key = (name, "worker") if rng.random() < 0.8 else (rng.choice(routers), "router")
            if rng.random() < 0.1:
                h.remove(UP, key)
            else:
                h.set(UP, key, rng.choice((0.0, 1.0, 1.0)))
        elif roll < 0.2:  # a router's scrape: its health gauges and decision counts
            r = rng.choice(routers)
            for w in rng.sample(names, 3):
                decisions[r][w] += rng.choice((0.0, 1.0))
            healthy = {w: float(rng.random() > 0.1) for w in names}
            p.observe_router(RouterSnapshot(r, "sglang-router", dict(decisions[r]), healthy), ts)
            p.update(ts)
        elif roll < 0.23:
            p.depart(name, ts)
            p.update(ts)
        elif roll < 0.26:  # discovery finds it again: judged with its next evidence
            p.rejoin(name)
        elif roll < 0.6:  # records served by a few workers, judged together
            served = rng.sample(names, 3)
            for w in served:
                p.served(w, ts)
            p.note_all([w for w in served if not p.unchanged_for(w)], ts)
        else:  # a scrape or a KV batch
            p.worker(name, ts)
            if not p.unchanged_for(name):
                p.note(name, ts)
        # the reference, from scratch: every up gauge, every router, every worker
        up = dict(h.gauges.get(UP, {}))
        for key, v in up.items():
            if v == 0 and not (key[1] == "worker" and key[0] in p.departed):
                since.setdefault(key, ts)
            elif v != 0:
                since.pop(key, None)
        for key in [k for k in since if k not in up or (k[1] == "worker" and k[0] in p.departed)]:
            del since[key]
        down = {k[0] for k, v in up.items() if v == 0}
        for snap in p.routers.values():
            down.update(w for w, v in snap.healthy.items() if v == 0)
        assert p.explicitly_down() == down, step
        assert all(p.is_healthy(w) == p.is_healthy(w, down) for w in names), step
        if roll >= 0.26 or 0.15 <= roll < 0.23:  # after an input, the pool is judged
            healthy = {w for w in p.workers if p.is_healthy(w, down)}
            assert p.pool == healthy, step
        left = p.left_pool_targets()
        assert p.down_since == since, step
        assert sorted(left) == sorted(k for k in since if p.left_pool(*k)), step
        assert p.left_workers() == {k[0] for k in left}, step
