"""Dynamo's KV-event messages decode into the same KvBatch values as vLLM's (fixtures in the source's format)."""

from __future__ import annotations

import json

import msgpack

from exporter.codecs.dynamo_events import decode, decode_message, worker_name
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
    env = decode_message(raw("enveloped"), 16)
    assert env is not None and env.publisher_id == 99 and env.sequence == 5
    (ev,) = env.events
    assert ev.worker == "11" and ev.event_id == 4
    assert abs(env.published_at - 1789095808.8378847) < 1e-6
    assert env.batches(0.0)[0].ts == env.published_at
    packed = msgpack.packb(FIXTURES["enveloped"], use_bin_type=True)
    assert decode_message(packed, 16) == env
    inner_bytes = dict(FIXTURES["enveloped"], payload=msgpack.packb(FIXTURES["enveloped"]["payload"]))
    assert decode(msgpack.packb(inner_bytes, use_bin_type=True), 16).event == ev.event
    as_list = dict(FIXTURES["enveloped"], payload=list(json.dumps(FIXTURES["enveloped"]["payload"]).encode()))
    assert decode(json.dumps(as_list), 16).event == ev.event


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
    src.handle_dynamo("s", raw("old_bare_stored"))  # event id 0 again: held until a restart is confirmed
    assert sink.restarts == [] and [b.seq for b in sink.batches] == [0, 1, 3]
    src.handle_dynamo("s", raw("new_stored_child"))  # event id 1 continues it: the worker restarted
    assert sink.restarts == [str(W)] and [b.seq for b in sink.batches] == [0, 1, 3, 0, 1]


def test_relayed_messages_apply_once_and_follow_the_restart_rule() -> None:
    from exporter.codecs.kv_stream import headers_for

    sink, h = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url="nats://x:1"), ShardSink(sink, ShardSpec()), h)
    payload = msgpack.packb([1.0, [["BlockStored", [1, 2], None, [], 16, None, "GPU"]], 0])
    restarted = msgpack.packb([9.0, [["BlockStored", [3], None, [], 16, None, "GPU"]], 0])  # the new process's first
    for stream_seq, seq in ((1, 0), (2, 1), (2, 1), (3, 4), (4, 0)):  # a redelivery, a gap, a restart
        data = restarted if stream_seq == 4 else payload
        src._handle("prefixscope.kv.w", headers_for("w", seq, data), data, stream_seq)
    assert [b.seq for b in sink.batches] == [0, 1, 4, 0]
    assert src.duplicates == 1
    assert h.snapshot()[0]["prefixscope_kv_event_missed_batches"][("w",)] == 2
    assert sink.restarts == ["w"]
    src._handle("prefixscope.kv.w", headers_for("w", 1, payload, restart=True), payload, 5)
    assert sink.restarts == ["w", "w"]


# ---- the bytes Dynamo's own runtime published (tests/fixtures/capture_dynamo_events.py) ------------
CAPTURE = json.loads((REPO / "tests" / "fixtures" / "dynamo_runtime_capture.json").read_text())
RUNTIMES = sorted(k for k in CAPTURE if not k.startswith("_"))


def follow(runtime: str, messages=None, workers: frozenset[str] | None = None):
    from exporter.bootstrap import bootstrap
    from exporter.config import Config

    parts = bootstrap(Config())
    src = NatsKvSource(NatsKvSettings(url="nats://x:1", relay=False, workers=workers, dynamo_block_size=4),
                       parts.state, parts.health)
    for m in CAPTURE[runtime]["messages"] if messages is None else messages:
        src.handle_dynamo(m["subject"], bytes.fromhex(m["data"]))
    return parts.state, parts.state.series().counters


def test_every_runtime_form_fills_the_same_index_for_workers_the_config_does_not_name() -> None:
    """1.6's batches, 1.0's single events and 1.0's legacy JSON: the same blocks, edges and ranks,
    with a worker list that names none of them (Dynamo's workers are taken, not filtered)."""
    for runtime in RUNTIMES:
        wid = CAPTURE[runtime]["worker_id"]
        st, counters = follow(runtime, workers=frozenset({"w0"}))
        w0, w1 = worker_name(wid), worker_name(wid, 1)
        assert sorted(st.index.blocks_of(w0)) == [101, 102, 103, 104], runtime
        assert sorted(st.index.blocks_of(w1)) == [201, 202], runtime
        assert [st.index.parent(b) for b in (102, 103, 104, 202)] == [101, 102, 103, 201], runtime
        assert set(counters["prefixscope_kv_event_sequence_gaps"].values()) == {0}, runtime


def test_a_lost_message_is_a_gap_of_its_own_worker_and_rank() -> None:
    for runtime in RUNTIMES:
        wid = CAPTURE[runtime]["worker_id"]
        messages = CAPTURE[runtime]["messages"]
        rank0 = [i for i, m in enumerate(messages) if decode_message(bytes.fromhex(m["data"]), 4).events[0].dp_rank == 0]
        lost = rank0[1]  # rank 0's second message never arrives
        _st, counters = follow(runtime, [m for i, m in enumerate(messages) if i != lost])
        gaps = {k: v for k, v in counters["prefixscope_kv_event_sequence_gaps"].items() if v}
        assert gaps == {(worker_name(wid),): 1}, runtime
        assert counters["prefixscope_kv_event_missed_batches"][(worker_name(wid),)] == 1, runtime


def test_the_same_worker_publishing_from_the_start_again_is_a_restart() -> None:
    for runtime in RUNTIMES:
        wid = CAPTURE[runtime]["worker_id"]
        messages = CAPTURE[runtime]["messages"]
        st, counters = follow(runtime, messages + messages)
        restarts = {k: v for k, v in counters["prefixscope_worker_restarts"].items() if v}
        assert restarts == {(worker_name(wid),): 1, (worker_name(wid, 1),): 1}, runtime
        assert sorted(st.index.blocks_of(worker_name(wid))) == [101, 102, 103, 104], runtime
        assert not {k: v for k, v in counters["prefixscope_kv_event_sequence_gaps"].items() if v}, runtime


def test_a_bad_event_in_a_batch_costs_that_event_only() -> None:
    env = msgpack.unpackb(bytes.fromhex(CAPTURE["1.6.1"]["messages"][0]["data"]), raw=False)
    good = msgpack.unpackb(env["payload"], raw=False, strict_map_key=False)[0]
    bad = dict(good, storage_tier="hbm3")
    unknown = dict(good, event=dict(good["event"], data={"evicted": {}}))
    env["payload"] = msgpack.packb([bad, good, unknown])
    h = Health()
    msg = decode_message(msgpack.packb(env), 4, health=h)
    assert msg is not None and msg.batched and [e.event_id for e in msg.events] == [good["event"]["event_id"]]
    errors = h.snapshot()[0]["prefixscope_ingest_errors"]
    assert errors == {("kv_events", "decode"): 1, ("kv_events", "unknown_event"): 1}


def test_storage_tiers_map_onto_the_media_vllm_names() -> None:
    base = FIXTURES["host_tier_dp1"]
    got = {tier: decode(json.dumps(dict(base, storage_tier=tier)), 16).event.medium
           for tier in ("device", "host_pinned", "disk", "external")}
    assert got == {"device": "GPU", "host_pinned": "CPU", "disk": "STORAGE", "external": "EXTERNAL"}
