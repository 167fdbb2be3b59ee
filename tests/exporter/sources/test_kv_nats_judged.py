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
from exporter.sources import kv_nats
from exporter.sources.kv_nats import RESTART_CONFIRM_S, NatsKvSettings, NatsKvSource
from tests import servers
from tests.support import REPO, wait_for


class Sink:
    def __init__(self) -> None:
        self.batches: list[tuple[str, int]] = []
        self.restarts: list[str] = []
        self.times: list[float] = []
        self.order: list[tuple[str, ...]] = []  # batches and restarts as they came

    def apply_kv_batch(self, batch, received_at) -> None:
        self.batches.append((batch.worker, batch.seq))
        self.times.append(batch.ts)
        self.order.append((batch.worker, str(batch.seq)))

    def worker_restarted(self, worker) -> None:
        self.restarts.append(worker)
        self.order.append((worker, "restart"))


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


# ---- a Dynamo number that went back is a restart only once confirmed ----------------------------
# The runtime's own bytes (tests/fixtures/dynamo_runtime_capture.json: rank 0's four messages, then
# rank 1's two), renumbered where a test needs another publisher, sequence or event_id.
CAPTURE = json.loads((REPO / "tests" / "fixtures" / "dynamo_runtime_capture.json").read_text())
RUNTIMES = ("1.6.1", "1.0.2", "1.0.2-jetstream")  # a batch per envelope, one event per envelope, bare JSON


def runtime_message(runtime: str, i: int, *, publisher: int | None = None, sequence: int | None = None,
                    event_id: int | None = None, worker: int | None = None) -> tuple[str, bytes]:
    """The runtime's ``i``-th message (subject, bytes) in its own wire form, renumbered as asked."""
    m = CAPTURE[runtime]["messages"][i]
    data = bytes.fromhex(m["data"])
    if runtime.endswith("jetstream"):
        events = [json.loads(data)]
    else:
        env = msgpack.unpackb(data, raw=False, strict_map_key=False)
        payload = msgpack.unpackb(env["payload"], raw=False, strict_map_key=False)
        events = payload if isinstance(payload, list) else [payload]
        env["publisher_id"] = env["publisher_id"] if publisher is None else publisher
        env["sequence"] = env["sequence"] if sequence is None else sequence
    for k, event in enumerate(events):
        event["event"]["event_id"] = event["event"]["event_id"] if event_id is None else event_id + k
        event["worker_id"] = event["worker_id"] if worker is None else worker
    if runtime.endswith("jetstream"):
        return m["subject"], json.dumps(events[0], separators=(",", ":")).encode()
    env["payload"] = msgpack.packb(payload, use_bin_type=True)
    return m["subject"], msgpack.packb(env, use_bin_type=True)


def publish_core(url: str, messages: list[tuple[str, bytes]]) -> None:
    """Publish on core NATS, in order, as Dynamo's event plane does."""
    import nats

    async def run() -> None:
        nc = await nats.connect(url)
        for subject, data in messages:
            await nc.publish(subject, data)
        await nc.flush()
        await nc.close()

    asyncio.run(run())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dynamo_source(url: str, runtime: str, sink: Sink, health: Health, clock: Clock | None = None) -> NatsKvSource:
    subject = CAPTURE[runtime]["messages"][0]["subject"]
    src = NatsKvSource(NatsKvSettings(url=url, relay=False, dynamo_subjects=(subject,), dynamo_block_size=4),
                       sink, health, clock=clock or Clock())
    src.start()
    assert src.wait_started(30)
    return src


def first_run(runtime: str) -> list[tuple[str, bytes]]:
    return [runtime_message(runtime, i) for i in range(4)]


def rank0(runtime: str) -> str:
    return str(CAPTURE[runtime]["worker_id"])


def ids(runtime: str, i: int) -> str:
    """The event_id of rank 0's ``i``-th message (a batch's seq): 1.6.1 numbers from 1, 1.0 from 0."""
    return str(i + 1 if runtime == "1.6.1" else i)


def new_run(runtime: str, i: int) -> tuple[str, bytes]:
    """What a restarted worker publishes as its ``i``-th message: the same numbers from the start, under
    a new publisher id in 1.6+ (each publisher draws its id when it is created)."""
    return runtime_message(runtime, i, publisher=4_242_424_242 if runtime == "1.6.1" else None)


@pytest.mark.parametrize(("runtime", "forged"), [("1.6.1", "sequence"), ("1.6.1", "publisher"),
                                                ("1.0.2", "sequence"), ("1.0.2-jetstream", "event_id")])
def test_one_forged_lower_number_amid_a_steady_series_clears_nothing(runtime: str, forged: str, nats_url: str) -> None:
    """A stray, duplicated or forged message whose number went back — the publisher's sequence (the
    first message again), the bare event_id, or (1.6) the event_id under a publisher id never seen —
    is held; the series going on refutes it: counted once as ``sequence``, dropped, the view untouched."""
    sink, health = Sink(), Health()
    src = dynamo_source(nats_url, runtime, sink, health)
    run = first_run(runtime)
    stray = runtime_message(runtime, 0, publisher=777 if forged == "publisher" else None)
    try:
        publish_core(nats_url, [*run[:3], stray, run[3]])
        wait_for(lambda: len(sink.batches) >= 4, what="the series")
    finally:
        src.close()
    assert sink.order == [(rank0(runtime), ids(runtime, i)) for i in range(4)]
    assert health.snapshot()[0]["prefixscope_ingest_errors"] == {("kv_events", "sequence"): 1}
    assert not (health.total("prefixscope_kv_event_missed_batches") or 0)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_restart_and_its_continuation_clear_the_view_once_and_apply_both(runtime: str, nats_url: str) -> None:
    sink, health = Sink(), Health()
    src = dynamo_source(nats_url, runtime, sink, health)
    try:
        publish_core(nats_url, [*first_run(runtime), new_run(runtime, 0), new_run(runtime, 1)])
        wait_for(lambda: len(sink.batches) >= 6, what="both runs")
    finally:
        src.close()
    w0 = rank0(runtime)
    assert sink.order == [(w0, ids(runtime, i)) for i in range(4)] + [(w0, "restart"), (w0, ids(runtime, 0)),
                                                                        (w0, ids(runtime, 1))]
    assert "prefixscope_ingest_errors" not in health.snapshot()[0]
    assert set(health.snapshot()[0]["prefixscope_kv_event_sequence_gaps"].values()) == {0}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_lone_restart_is_confirmed_once_nothing_refutes_it_for_the_confirm_time(runtime: str,
                                                                                    nats_url: str) -> None:
    """A restarted worker may publish its first request's stores and go quiet: held, it delays no
    other worker, and the source's own loop confirms it once ``RESTART_CONFIRM_S`` passed on its clock."""
    sink, health, clock = Sink(), Health(), Clock()
    src = dynamo_source(nats_url, runtime, sink, health, clock)
    w0 = rank0(runtime)
    w1 = f"{w0}-dp1"
    try:
        publish_core(nats_url, [*first_run(runtime), new_run(runtime, 0), runtime_message(runtime, 4)])
        wait_for(lambda: (w1, ids(runtime, 0)) in sink.order, what="rank 1, past the held message")
        clock.now += RESTART_CONFIRM_S - 0.5
        assert sink.restarts == [] and len(sink.batches) == 5
        clock.now += 0.5
        wait_for(lambda: sink.restarts, what="the restart confirmed")
        wait_for(lambda: len(sink.batches) == 6, what="the held message applied")
    finally:
        src.close()
    assert sink.order[4:] == [(w1, ids(runtime, 0)), (w0, "restart"), (w0, ids(runtime, 0))]
    assert "prefixscope_ingest_errors" not in health.snapshot()[0]


@pytest.mark.parametrize(("keys", "held_bytes", "kept"), [(8, 2**30, 8), (65_536, 3, 3)])
def test_held_messages_stay_bounded_however_many_keys_go_back(keys: int, held_bytes: int, kept: int,
                                                                nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of 50 workers' event_id goes back once and nothing follows: at most ``MAX_PUBLISHERS``
    held (``MAX_HELD_BYTES`` of them in all), the oldest forgotten — counted, never applied."""
    runtime, n = "1.0.2-jetstream", 50
    size = len(runtime_message(runtime, 0, event_id=0, worker=1_000_000)[1])
    monkeypatch.setattr(kv_nats, "MAX_PUBLISHERS", keys)
    monkeypatch.setattr(kv_nats, "MAX_HELD_BYTES", held_bytes * size)
    sink, health = Sink(), Health()
    src = dynamo_source(nats_url, runtime, sink, health)
    messages = []
    for k in range(n):
        messages += [runtime_message(runtime, 0, event_id=5, worker=1_000_000 + k),
                     runtime_message(runtime, 0, event_id=0, worker=1_000_000 + k)]
    try:
        publish_core(nats_url, [*messages, runtime_message(runtime, 0, worker=7)])
        wait_for(lambda: ("7", "0") in sink.order, what="every message")
    finally:
        src.close()
    assert len(src._dyn_held) == kept and len(src._dyn_held_workers) == kept and src._held_bytes <= kept * size
    assert len(src._dyn_events) <= keys
    assert health.snapshot()[0]["prefixscope_ingest_errors"] == {("kv_events", "sequence"): n - kept}
    assert sink.restarts == [] and len(sink.batches) == n + 1
