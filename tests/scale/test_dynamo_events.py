"""Dynamo's KV-event messages decode into the same KvBatch values as vLLM's (fixtures in the source's format)."""

from __future__ import annotations

import json

import msgpack

from exporter.codecs.dynamo_events import decode, worker_name
from exporter.core.health import Health
from exporter.core.sharding import ShardSink, ShardSpec
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored
from exporter.sources.kv_nats import NatsKvSettings, NatsKvSource
from tests.support import REPO

FIXTURES = json.loads((REPO / "tests" / "fixtures" / "dynamo_router_events.json").read_text())
W = 7587888160896139266


def raw(name: str) -> bytes:
    return json.dumps(FIXTURES[name]).encode()


def test_stored_removed_cleared_in_json() -> None:
    a = decode(raw("old_bare_stored"), 16)
    assert a is not None and a.worker == str(W) and a.event_id == 0
    assert a.event == BlockStored((15760518052499183552, 42), None, 16, 32, "GPU")
    b = decode(raw("new_stored_child"), 16)
    assert b is not None and b.event == BlockStored((43,), 42, 16, 16, "GPU")
    assert decode(raw("new_removed"), 16).event == BlockRemoved((43,), "GPU")
    assert isinstance(decode(raw("cleared"), 16).event, AllBlocksCleared)


def test_tier_and_dp_rank_name_the_cache() -> None:
    ev = decode(raw("host_tier_dp1"), 16)
    assert ev is not None and ev.worker == worker_name(W, 1) == f"{W}-dp1" and ev.event.medium == "CPU"


def test_envelope_json_and_msgpack_and_bytes_payload() -> None:
    env = decode(raw("enveloped"), 16)
    assert env is not None and env.worker == "11" and env.event_id == 4
    assert abs(env.published_at - 1789095808.8378847) < 1e-6
    assert env.batch(0.0).ts == env.published_at
    packed = msgpack.packb(FIXTURES["enveloped"], use_bin_type=True)
    assert decode(packed, 16) == env
    inner_bytes = dict(FIXTURES["enveloped"], payload=msgpack.packb(FIXTURES["enveloped"]["payload"]))
    assert decode(msgpack.packb(inner_bytes, use_bin_type=True), 16).event == env.event
    as_list = dict(FIXTURES["enveloped"], payload=list(json.dumps(FIXTURES["enveloped"]["payload"]).encode()))
    assert decode(json.dumps(as_list), 16).event == env.event


def test_bad_messages_are_counted_not_raised() -> None:
    h = Health()
    assert decode(raw("unknown_kind"), 16, health=h) is None
    assert decode(raw("negative_hash"), 16, health=h) is None
    assert decode(b"\xc1 not msgpack", 16, health=h) is None
    assert decode(b'{"worker_id": 1}', 16, health=h) is None
    errors = h.snapshot()[0]["prefixscope_ingest_errors"]
    assert errors[("kv_events", "unknown_event")] == 1 and errors[("kv_events", "decode")] == 3


class Sink:
    def __init__(self) -> None:
        self.batches = []
        self.restarts = []

    def apply_kv_batch(self, batch, received_at) -> None:
        self.batches.append(batch)

    def worker_restarted(self, worker) -> None:
        self.restarts.append(worker)


def test_the_nats_source_sequences_dynamo_events_by_event_id() -> None:
    sink, h = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url="nats://x:1", relay=False), sink, h, clock=lambda: 5.0)
    for name in ("old_bare_stored", "new_stored_child", "cleared"):  # event ids 0, 1, then 3: one missed
        src.handle_dynamo("namespace.dynamo.component.backend.kv_events", raw(name))
    assert [b.seq for b in sink.batches] == [0, 1, 3]
    assert h.snapshot()[0]["prefixscope_kv_event_missed_batches"][(str(W),)] == 1
    src.handle_dynamo("s", raw("old_bare_stored"))  # event id 0 again: the worker restarted
    assert sink.restarts == [str(W)]


def test_relayed_messages_apply_once_and_follow_the_restart_rule() -> None:
    from exporter.codecs.kv_stream import headers_for

    sink, h = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url="nats://x:1"), ShardSink(sink, ShardSpec()), h)
    payload = msgpack.packb([1.0, [["BlockStored", [1, 2], None, [], 16, None, "GPU"]], 0])
    for stream_seq, seq in ((1, 0), (2, 1), (2, 1), (3, 4), (4, 0)):  # a redelivery, a gap, a restart
        src._handle("prefixscope.kv.w", headers_for("w", seq, payload), payload, stream_seq)
    assert [b.seq for b in sink.batches] == [0, 1, 4, 0]
    assert src.duplicates == 1
    assert h.snapshot()[0]["prefixscope_kv_event_missed_batches"][("w",)] == 2
    assert sink.restarts == ["w"]
    src._handle("prefixscope.kv.w", headers_for("w", 1, payload, restart=True), payload, 5)
    assert sink.restarts == ["w", "w"]
