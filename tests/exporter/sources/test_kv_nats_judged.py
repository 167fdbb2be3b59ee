"""Relayed KV-event messages are judged, not trusted (a real nats-server with JetStream on 127.0.0.1).

Before, one junk, duplicate, out-of-order or absurd-sequence message on a worker's subject — seq
−1 or 2^63, another worker's name, a batch already applied — was taken for a worker restart and
wiped the worker's view; 2^63 counted 9.2×10^18 missed batches. Messages go into the stream as
the relay writes them (subject, headers, msgpack payload) and the exporter's source reads them.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from exporter.codecs.kv_stream import DEFAULT_PREFIX, DEFAULT_STREAM, H_WORKER, headers_for, subject_for
from exporter.core.health import Health
from exporter.core.sharding import ShardSink, ShardSpec
from exporter.sources.kv_nats import NatsKvSettings, NatsKvSource
from tests import servers
from tests.support import REPO, wait_for


class Sink:
    def __init__(self) -> None:
        self.batches: list[tuple[str, int]] = []
        self.restarts: list[str] = []
        self.times: list[float] = []

    def apply_kv_batch(self, batch, received_at) -> None:
        self.batches.append((batch.worker, batch.seq))
        self.times.append(batch.ts)

    def worker_restarted(self, worker) -> None:
        self.restarts.append(worker)


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    with servers.nats_server(tmp_path / "js") as url:
        yield url


def payload(ts: float, block: int) -> bytes:
    return msgpack.packb([ts, [["BlockStored", [block], None, [], 16, None, "GPU"]], 0])


DEDUPE_S = 0.5  # the stream's duplicate window, short: a repeat after it is stored again


def publish(url: str, messages: list[tuple[str, dict[str, str], bytes] | None]) -> None:
    """Publish in order; ``None`` waits out the stream's duplicate window."""
    import nats

    async def run() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name=DEFAULT_STREAM, subjects=[f"{DEFAULT_PREFIX}.>"], duplicate_window=DEDUPE_S)
        for message in messages:
            if message is None:
                await asyncio.sleep(DEDUPE_S * 2)
                continue
            subject, headers, data = message
            await js.publish(subject, data, headers=headers)
        await nc.close()

    asyncio.run(run())


def relayed(worker: str, seq: int, data: bytes, **headers: str) -> tuple[str, dict[str, str], bytes]:
    return subject_for(DEFAULT_PREFIX, worker), {**headers_for(worker, seq, data), **headers}, data


def test_junk_duplicate_reordered_and_absurd_messages_are_counted_and_wipe_nothing(nats_url: str) -> None:
    first = payload(1.0, 1)
    w1_on_w0 = relayed("w0", 0, payload(2.5, 99))
    w1_on_w0[1][H_WORKER] = "w1"
    messages: list[tuple[str, dict[str, str], bytes] | None] = [
        relayed("w0", 0, first),
        relayed("w0", 1, payload(2.0, 2)),
        relayed("w0", -1, payload(2.1, 50)),  # junk
        relayed("w0", 2**63, payload(2.2, 51)),  # absurd
        relayed("w0", 5_000_000, payload(2.3, 52)),  # a jump no next message confirms
        w1_on_w0,  # another worker's name on w0's subject
        None,
        relayed("w0", 1, payload(2.0, 2)),  # a duplicate past the stream's window
        relayed("w0", 0, first),  # the first batch again: no restart
        relayed("w0", 3, payload(3.0, 3)),  # seq 2 lost: one missed batch
        relayed("w0", 2, payload(2.9, 4)),  # seq 2 after 3: out of order
        relayed("w0", 4, payload(4.0, 5)),
        relayed("w0", 0, payload(9.0, 6), **{"Prefixscope-Restart": "1"}),  # the relay saw a restart
    ]
    publish(nats_url, messages)
    sink, health = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url=nats_url), ShardSink(sink, ShardSpec()), health)
    src.start()
    try:
        assert src.wait_started(30)
        wait_for(lambda: len(sink.batches) >= 5, what="the good batches")
    finally:
        src.close()
    assert sink.batches == [("w0", 0), ("w0", 1), ("w0", 3), ("w0", 4), ("w0", 0)]
    assert sink.restarts == ["w0"]  # only the relay's restart, after every bad message
    errors = health.snapshot()[0]["prefixscope_ingest_errors"]
    assert errors[("kv_events", "sequence")] == 3 and errors[("kv_events", "identity")] == 1
    assert errors[("kv_events", "duplicate")] == 3  # seq 1 again, seq 0 again, seq 2 late
    assert health.snapshot()[0]["prefixscope_kv_event_missed_batches"][("w0",)] == 1


def test_a_jump_the_next_message_confirms_is_loss_not_junk() -> None:
    sink, health = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url="nats://127.0.0.1:1"), ShardSink(sink, ShardSpec()), health)
    for stream_seq, seq in ((1, 0), (2, 1), (3, 3_000_000), (4, 3_000_001)):
        src._handle(*relayed("w0", seq, payload(float(stream_seq), stream_seq))[:3], stream_seq)
    assert sink.batches == [("w0", 0), ("w0", 1), ("w0", 3_000_001)]
    assert health.snapshot()[0]["prefixscope_kv_event_missed_batches"][("w0",)] == 2_999_999
    assert sink.restarts == []


DYNAMO_SUBJECT = "namespace.dynamo.component.backend.kv_events"
DYNAMO = json.loads((REPO / "tests" / "fixtures" / "dynamo_router_events.json").read_text())


def dynamo(name: str, event_id: int, sequence: int | None = None) -> bytes:
    message = copy.deepcopy(DYNAMO[name])
    event = message["payload"]["event"] if "payload" in message else message["event"]
    event["event_id"] = event_id
    if sequence is not None:
        message["sequence"] = sequence
    return json.dumps(message).encode()


def test_absurd_dynamo_sequences_are_counted_and_wipe_nothing(nats_url: str) -> None:
    """Dynamo's messages come on core NATS, where anyone on the subject may publish: an event_id or
    envelope sequence beyond 2^53, or a jump no next message confirms, is rejected and counted —
    not billions of missed batches, and not the reason the worker's next true message reads as a
    restart."""
    import nats

    sink, health = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url=nats_url, relay=False, dynamo_subjects=(DYNAMO_SUBJECT,)), sink, health)
    src.start()
    messages = [dynamo("old_bare_stored", 0),
                dynamo("old_bare_stored", 2**63),  # absurd
                dynamo("new_stored_child", 5_000_000),  # a jump no next message confirms
                dynamo("new_stored_child", 1),
                dynamo("enveloped", 4, sequence=5),
                dynamo("enveloped", 5, sequence=2**60),  # an absurd envelope sequence
                dynamo("enveloped", 6, sequence=6)]

    async def run() -> None:
        nc = await nats.connect(nats_url)
        for data in messages:
            await nc.publish(DYNAMO_SUBJECT, data)
        await nc.flush()
        await nc.close()

    try:
        assert src.wait_started(30)
        asyncio.run(run())
        wait_for(lambda: len(sink.batches) >= 4, what="the good messages")
    finally:
        src.close()
    worker = str(DYNAMO["old_bare_stored"]["worker_id"])
    assert sink.batches == [(worker, 0), (worker, 1), ("11", 4), ("11", 6)]
    assert sink.restarts == []
    assert health.snapshot()[0]["prefixscope_ingest_errors"][("kv_events", "sequence")] == 3
    assert (health.total("prefixscope_kv_event_missed_batches") or 0) == 0


def test_an_envelope_time_past_u64_reads_as_no_time_and_the_message_is_applied(nats_url: str) -> None:
    """A publish time too large for a float (past Dynamo's u64) raised out of the decoder before:
    the message was lost uncounted on the subscription's callback."""
    import nats

    sink, health = Sink(), Health()
    src = NatsKvSource(NatsKvSettings(url=nats_url, relay=False, dynamo_subjects=(DYNAMO_SUBJECT,)), sink, health,
                       clock=lambda: 1234.0)
    src.start()
    huge_ns = json.loads(dynamo("enveloped", 4, sequence=5))
    huge_ns["published_at_ns"] = 10**400
    huge_ms = json.loads(dynamo("enveloped", 5, sequence=6))
    del huge_ms["published_at_ns"]
    huge_ms["published_at"] = 10**400

    async def run() -> None:
        nc = await nats.connect(nats_url)
        for message in (huge_ns, huge_ms):
            await nc.publish(DYNAMO_SUBJECT, json.dumps(message).encode())
        await nc.flush()
        await nc.close()

    try:
        assert src.wait_started(30)
        asyncio.run(run())
        wait_for(lambda: len(sink.batches) >= 2, what="both messages")
    finally:
        src.close()
    assert sink.batches == [("11", 4), ("11", 5)]
    # the first falls back on its milliseconds; the second has no readable time: stamped when received
    assert sink.times == [DYNAMO["enveloped"]["published_at"] / 1e3, 1234.0]
