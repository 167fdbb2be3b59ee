"""The cluster benchmark: its wire format, its reading of the exporter's page, and its smallest run."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from bench._cluster_burst import TS_AT, BusyWorker, cycle_tails, stamp
from bench._cluster_fleet import (
    END_SEQ,
    Shape,
    WorkerStream,
    batch_payload,
    chain_hashes,
    family_of,
    prefix_hashes,
)
from bench._cluster_records import RecordMaker
from bench.cluster import (
    Scrape,
    Settings,
    bench_topology,
    busiest,
    by_duty,
    by_exporter_duty,
    duty_cpu,
    follow_verdict,
    ramp_table,
    read_page,
    run_size,
    table,
)
from exporter.sources.records import parse_ndjson
from fleet.cache import Removed, Stored
from fleet.kv_publisher import encode_batch
from prefixscope.catalog import DUTY_NAMES
from prefixscope.topology import parse_topology

SMALL = Shape(blocks_per_event=4, prefix_blocks=2, families=2, resident_chains=6, cycle_chains=10,
              capacity_blocks=64)


def test_spliced_batches_are_the_bytes_the_fleet_publisher_sends() -> None:
    stream = WorkerStream(5, SMALL)
    events = stream.next_events(1)
    tokens = tuple(msgpack.unpackb(events[0])[3])
    prefix = prefix_hashes(family_of(5, SMALL), SMALL)
    expected = encode_batch([Stored(tuple(chain_hashes(5, SMALL.resident_chains, SMALL)), prefix[-1], tokens, 16),
                             Removed(tuple(chain_hashes(5, 0, SMALL)))], 1234.5)
    assert batch_payload(1234.5, events) == expected


def _apply(resident: set[int], payload: bytes) -> None:
    for ev in msgpack.unpackb(payload)[1]:
        if ev[0] == "BlockStored":
            assert ev[2] is None or ev[2] in resident  # the parent is always known
            resident.update(ev[1])
        else:
            assert set(ev[1]) <= resident  # only resident blocks are evicted
            resident.difference_update(ev[1])


def test_the_store_evict_cycle_keeps_every_worker_at_its_resident_count() -> None:
    stream = WorkerStream(3, SMALL)
    resident: set[int] = set()
    _apply(resident, batch_payload(0.0, stream.warm_events()))
    assert len(resident) == SMALL.resident_blocks
    for steps in (1, 3, 7, 2, 11):  # several cycles, in batches of different sizes
        _apply(resident, batch_payload(0.0, stream.next_events(steps)))
        assert len(resident) == SMALL.resident_blocks


def test_records_are_valid_and_carry_the_workers_chains() -> None:
    maker = RecordMaker(4, SMALL, seed=1)
    body = maker.body(20)
    records, errors = parse_ndjson(body, 1 << 20, now=time.time())
    assert errors == [] and len(records) == 20
    for rec in records:
        assert rec.worker in {"w0000", "w0001", "w0002", "w0003"}
        w = int(rec.worker[1:])
        assert rec.block_hashes is not None
        assert list(rec.block_hashes[:SMALL.prefix_blocks]) == prefix_hashes(family_of(w, SMALL), SMALL)
        chain = list(rec.block_hashes[SMALL.prefix_blocks:])
        assert any(chain == chain_hashes(w, j, SMALL) for j in range(SMALL.cycle_chains))


def test_the_fleets_topology_is_valid_with_eight_workers_a_node_and_domain() -> None:
    names = [f"w{i}" for i in range(20)]
    topo = parse_topology(bench_topology(names))
    assert [w.name for w in topo.workers] == names
    domains = [w.nvlink_domain for w in topo.workers]
    assert domains.count(domains[0]) == 8 and len(set(domains)) == 3
    assert all(w.nvlink_domain.startswith(w.node + "/") for w in topo.workers)


def test_read_page_and_the_follow_verdict() -> None:
    text = "\n".join([
        "# HELP prefixscope_kv_event_lag_seconds x",
        'prefixscope_kv_event_lag_seconds{worker="a"} 0.25',
        'prefixscope_kv_event_lag_seconds{worker="b"} 1.5',
        'prefixscope_kv_events_applied_total{worker="a",event="BlockStored"} 10.0',
        'prefixscope_kv_events_applied_total{worker="b",event="BlockRemoved"} 5.0',
        'prefixscope_up{target="a",kind="worker"} 1.0',
        "other_metric 3",
    ])
    page = read_page(text)
    assert page.series == 6  # every sample line, read or not
    assert page.largest("prefixscope_kv_event_lag_seconds") == 1.5
    assert page.total("prefixscope_kv_events_applied_total") == 15.0
    assert page.count("prefixscope_up", 1.0, 'kind="worker"') == 1

    def scrape(mono: float, lag: float, lost: float = 0.0, applied: float = 0.0) -> Scrape:
        return Scrape(at=mono, mono=mono, seconds=0.01, size=1, status=200, lag_max=lag, stale_max=0.1,
                      applied=applied, lost=lost)

    good = follow_verdict([scrape(0, 0.1, applied=0), scrape(2, 0.3, applied=100)], max_lag=1.0, batch_interval=0.2)
    assert good.followed and good.lag_max_s == 0.3 and good.applied_per_s == 50.0
    late = follow_verdict([scrape(0, 0.1), scrape(2, 1.4)], max_lag=1.0, batch_interval=0.2)
    assert not late.followed and "lag" in late.why
    lossy = follow_verdict([scrape(0, 0.1, lost=0), scrape(2, 0.1, lost=3)], max_lag=1.0, batch_interval=0.2)
    assert not lossy.followed and "lost" in lossy.why
    assert not follow_verdict([], max_lag=1.0, batch_interval=0.2).followed


def test_cpu_is_split_by_the_threads_doing_each_duty() -> None:
    before = {1: ("python", 1.0), 2: ("python", 5.0), 3: ("ZMQbg/IO/0", 0.5), 4: ("python", 0.0)}
    after = {1: ("python", 1.1), 2: ("python", 7.0), 3: ("ZMQbg/IO/0", 0.9), 5: ("python", 0.3)}
    assert busiest(before, after, [1, 2, 4]) == 2
    assert busiest(before, before, [1, 2]) is None
    split = by_duty(before, after, {2: "kv_ingest", 3: "kv_ingest", 5: "records", 4: "render"}, total=3.0)
    assert split["kv_ingest"] == 2.0 + 0.4 and split["records"] == 0.3 and split["render"] == 0.0
    assert abs(split["other"] - (3.0 - 2.7)) < 1e-9  # thread 1, and thread 4 that ended


def test_cpu_is_split_by_the_exporters_own_duty_counters_when_it_exports_them() -> None:
    page = read_page('prefixscope_exporter_duty_cpu_seconds_total{duty="kv_ingest"} 2.5\n'
                     'prefixscope_exporter_duty_cpu_seconds_total{duty="render"} 1.0\n', ("prefixscope_exporter_duty_cpu_seconds_total",))
    after = duty_cpu(page)
    assert after == {"kv_ingest": 2.5, "render": 1.0}
    assert duty_cpu(read_page("prefixscope_up 1\n")) is None  # an older exporter: the /proc estimate instead
    split = by_exporter_duty({"kv_ingest": 0.5, "render": 0.75}, after, total=3.0)
    assert split["kv_ingest"] == 2.0 and split["render"] == 0.25 and split["scrape"] == 0.0
    assert split["other"] == 0.75


def test_smallest_run_follows_three_workers_and_reports_every_figure() -> None:
    """Three workers, a few seconds a phase: the real exporter process, fleet and load processes."""
    s = Settings(sizes=[3], rate=10, records_per_worker=2, duration=4, phase=1.5, ramp=0, scrape_every=1,
                 worker_scrape_interval=1, shape=SMALL)
    r = run_size(3, s, log=lambda _msg: None, ramp=False)
    assert r["workers"] == 3 and r["startup_s"] > 0
    # split by the exporter's own per-duty counters (prefixscope_exporter_duty_cpu_seconds_total)
    assert r["cpu_split"] == "exporter"
    assert set(r["cpu"]) == {*DUTY_NAMES, "other", "total"}
    assert r["cpu"]["kv_ingest"] > 0 and r["cpu"]["scrape"] > 0 and r["cpu"]["render"] > 0
    assert sum(v for d, v in r["cpu"].items() if d != "total") <= r["cpu"]["total"] + 1e-9
    # (the HTTP edge's scrape threads start with its first health probe, before the render phase,
    # so threads are not a duty's count here: its CPU comes from the exporter's own counters)
    assert r["threads_by_duty"]["kv_ingest"] >= 1
    assert r["cpu"]["total"] >= 0 and r["rss_mb"] > 0
    kv = r["kv"]
    assert kv["applied_events"] > 0 and kv["published_events"] > 0
    assert kv["applied_events"] == kv["published_events"]  # a light load loses nothing
    assert kv["lag_max_s"] is not None and kv["lag_max_s"] >= 0
    assert kv["kv_ingest_errors"] == 0 and kv["lost_batches_total"] == 0
    assert kv["records_accepted"] > 0 and kv["records_rejected"] == 0
    assert r["render"]["scrapes"] >= 2 and r["render"]["p50_s"] is not None and r["render"]["p99_s"] is not None
    assert r["followed"] and r["max_followed_rate_per_worker"] == 10 and r["max_followed_events_per_s"] > 0
    assert table([r]).splitlines()[2].replace(" ", "").startswith("|3|")


HIGH = Shape(blocks_per_event=64, prefix_blocks=2, families=2, resident_chains=3, cycle_chains=6, capacity_blocks=512)


def test_the_high_rate_fleets_prebuilt_messages_are_the_spliced_fleets_bytes() -> None:
    """Every message a busy worker sends, built ahead without its timestamp, is the batch
    ``bench._cluster_fleet`` would splice for the same events and time (one event a message)."""
    ctx = zmq.Context()
    try:
        worker = BusyWorker(ctx, 4, HIGH, events_per_batch=1, buffer=8)
        stream = WorkerStream(4, HIGH)
        assert worker.warm[TS_AT + 8:] == batch_payload(0.0, stream.warm_events())[TS_AT + 8:]
        events = stream.next_events(3 * HIGH.cycle_chains)  # three cycles: the prebuilt messages repeat
        for seq in range(1, len(events) + 1):
            assert worker.payload(seq, stamp(1234.5)) == batch_payload(1234.5, [events[seq - 1]])
        worker.pub.close(0)
        worker.router.close(0)
    finally:
        ctx.term()
    with pytest.raises(ValueError):
        cycle_tails(WorkerStream(4, HIGH), 5)  # a message's events must tile the cycle


def test_the_high_rate_cycle_keeps_the_index_bounded_and_the_replay_resends_the_same_bytes() -> None:
    ctx = zmq.Context()
    try:
        worker = BusyWorker(ctx, 2, HIGH, events_per_batch=2, buffer=5)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(worker.pub.getsockopt_string(zmq.LAST_ENDPOINT))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(worker.router.getsockopt_string(zmq.LAST_ENDPOINT))
        time.sleep(0.3)  # the subscription reaches the PUB socket
        worker.send_warm(HIGH)
        sent = 23
        for i in range(sent):
            worker.send(1, stamp(100.0 + i), 100.0 + i, 2)
        live = [sub.recv_multipart() for _ in range(sent + 1)]
        resident: set[int] = set()
        for _topic, _seq8, payload in live:
            _apply(resident, payload)
            assert len(resident) == HIGH.resident_blocks  # a store and an eviction a message
        assert [int.from_bytes(f[1], "big") for f in live] == list(range(sent + 1))
        assert worker.events == 1 + HIGH.resident_chains + 2 * sent and worker.batches == sent + 1
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # from 0: the warm cache, then what the buffer holds
        assert worker.router.poll(5000)
        worker.serve_replay()
        replies = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                break
            replies.append(frames[-2:])
        assert [int.from_bytes(s, "big") for s, _ in replies] == [0, *range(sent + 1 - 5, sent + 1)]
        assert [p for _, p in replies] == [live[0][2]] + [f[2] for f in live[-5:]]
        for s in (sub, dealer, worker.pub, worker.router):
            s.close(0)
    finally:
        ctx.term()


def test_smallest_high_rate_run_ramps_holds_and_reports_what_it_shed() -> None:
    """Three busy workers (prebuilt 64-block messages): a ramp step, a short hold, every figure reported."""
    s = Settings(sizes=[3], rate=20, records_per_worker=0.5, duration=4, phase=1.5, step=3, ramp=1, ramp_factor=4,
                 scrape_every=1, worker_scrape_interval=1, shape=HIGH, high_rate=True, overload=3)
    r = run_size(3, s, log=lambda _msg: None)
    assert r["fleet"].startswith("prebuilt") and r["blocks_per_event"] == 64 and r["events_per_batch"] == 1
    assert len(r["ramp"]) == 1 and r["ramp"][0]["blocks_per_s"] > 0
    held = r["overload"]
    tried = [(20.0, r["followed"])] + [(st["rate_per_worker"], st["followed"]) for st in r["ramp"]]
    missed = [rate for rate, ok in tried if not ok]
    # a step past the lowest rate not followed, or past the highest when every one was
    assert held is not None and held["rate_per_worker"] == (min(missed) if missed else max(tried)[0]) * 4
    assert held["lag_alert_threshold_s"] > 0 and held["lag_alert_for_s"] > 0
    assert held["rss_mb_max"] is not None and held["scrapes_ok"] >= 2
    assert {"missed_batches_grew", "replays_recovered", "replays_unhealed", "alert_expr_scrapes"} <= set(held)
    assert held["after_stop"]["lag_max_s"] is not None
    kv = r["kv"]
    assert kv["kv_ingest_errors"] == 0 and kv["applied_events"] > 0
    if r["followed"] and r["ramp"][0]["followed"]:
        assert r["max_followed_blocks_per_s"] > 0 and r["blocks_per_exporter_core"] > 0
    assert "held" in ramp_table([r])
