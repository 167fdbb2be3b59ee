"""The breach record advances on the exporter's own clock, in the background, not on API calls.

A worker's KV stream goes quiet: ``kv_event_staleness`` (alert after 120 s, ``for: 2m`` in the
packaged thresholds) breaches once its last batch is more than 120 s old. Time is the exporter's
injectable clock, moved by hand; the loop's steps are ``evaluate_once`` calls, as its thread
makes them every ``breach_interval``.
"""

from __future__ import annotations

import time

import pytest
import requests

from exporter.bootstrap import bootstrap
from exporter.config import Config
from exporter.loops.breach_loop import DEFAULT_INTERVAL_S, BreachLoop
from exporter.main import Runtime
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders
from tests.support import wait_for

KEY = "kv_event_staleness"
# the only worker of the fleet is the stale one: the silent share of the fleet breaches with it
BREACHED = {KEY: 1_130.0, "kv_event_blind_share": 1_130.0}
LAST_BATCH = 1_000.0  # breaches from 1_120 on (staleness > 120 s); fires 120 s after the breach began


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def parts_at(clock: Clock, cfg: Config | None = None):
    parts = bootstrap(cfg, clock=clock)
    parts.state.apply_kv_batch(KvBatch("w0", 0, LAST_BATCH, (BlockStored((1, 2), None, 16),)), LAST_BATCH)
    return parts


def staleness(groups: dict) -> dict:
    return next(c for s in groups["steps"] for c in s["checks"] if c["key"] == KEY)


def test_a_breach_between_two_requests_keeps_the_start_the_loop_saw() -> None:
    clock = Clock(LAST_BATCH + 50)
    parts = parts_at(clock)
    groups = ApiBuilders(parts.state, breaches=parts.breaches).routes()["groups"]
    assert staleness(groups({}))["alert_state"] == "inactive"
    for t in (1_100.0, 1_130.0, 1_160.0, 1_190.0):  # the loop's steps; nobody calls the API
        clock.t = t
        parts.breach_loop.evaluate_once()
    assert parts.breaches.since() == BREACHED
    clock.t = 1_200.0
    later = staleness(groups({}))
    assert (later["status"], later["alert_state"], later["breaching_since"], later["fires_in_s"]) == (
        "firing", "pending", 1_130.0, 50.0)
    assert groups({})["headline"]["fires_in_s"] == 50.0
    clock.t = 1_250.0  # 120 s after the breach began: firing, whether or not the loop ran since
    fired = staleness(groups({}))
    assert (fired["alert_state"], fired["breaching_since"], fired["fires_in_s"]) == ("firing", 1_130.0, None)


def test_requests_do_not_advance_the_record() -> None:
    clock = Clock(1_130.0)
    parts = parts_at(clock)
    groups = ApiBuilders(parts.state, breaches=parts.breaches).routes()["groups"]
    first = staleness(groups({}))
    # Not yet seen by the loop: it began breaching no earlier than now.
    assert (first["alert_state"], first["breaching_since"], first["fires_in_s"]) == ("pending", 1_130.0, 120.0)
    assert parts.breaches.since() == {}  # the request recorded nothing
    clock.t = 1_400.0
    assert staleness(groups({}))["breaching_since"] == 1_400.0  # still nothing recorded: no start to go by


def test_a_breach_that_ended_between_requests_is_forgotten() -> None:
    clock = Clock(1_130.0)
    parts = parts_at(clock)
    parts.breach_loop.evaluate_once()
    assert parts.breaches.since() == BREACHED
    clock.t = 1_140.0
    parts.state.apply_kv_batch(KvBatch("w0", 1, 1_140.0, (BlockStored((3,), 2, 16),)), 1_140.0)
    parts.breach_loop.evaluate_once()  # the stream is fresh again
    assert parts.breaches.since() == {}
    clock.t = 1_300.0  # quiet again from 1_260: a new breach, pending from the loop's next step
    parts.breach_loop.evaluate_once()
    got = staleness(ApiBuilders(parts.state, breaches=parts.breaches).routes()["groups"]({}))
    assert (got["breaching_since"], got["alert_state"]) == (1_300.0, "pending")


def test_the_loop_thread_records_on_the_exporters_clock_and_stops() -> None:
    clock = Clock(1_130.0)
    parts = parts_at(clock, Config(breach_interval=0.01))
    assert parts.breach_loop.interval == 0.01
    loop = parts.breach_loop.start()
    try:
        assert wait_for(lambda: parts.breaches.since(), "the loop's first evaluation") == BREACHED
        clock.t = 1_135.0
        first = loop.record.since()
    finally:
        loop.close(timeout=5)
    assert not loop.running
    assert first == parts.breaches.since() == BREACHED  # the start stays the first breaching evaluation's
    with pytest.raises(ValueError):
        BreachLoop(parts.state, parts.breaches, interval=0)


def test_the_default_interval_is_a_few_seconds_and_configurable() -> None:
    assert Config().breach_interval == DEFAULT_INTERVAL_S == 5.0
    assert bootstrap().breach_loop.interval == 5.0


def test_the_runtime_starts_and_stops_the_loop_and_its_api_reads_the_loops_record() -> None:
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0", breach_interval=0.05)).start()
    try:
        assert runtime.breach_loop.running
        now = time.time()
        runtime.state.apply_kv_batch(KvBatch("w0", 0, now - 600, (BlockStored((1,), None, 16),)), now - 600)
        since = wait_for(lambda: runtime.breach_loop.record.since().get(KEY), "the loop to record the breach")
        body = requests.get(runtime.url + "/api/v1/groups", timeout=5).json()["data"]
        assert staleness(body)["breaching_since"] == since
    finally:
        runtime.stop()
    assert not runtime.breach_loop.running
