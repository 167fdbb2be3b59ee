"""KV events received on a real ZMQ SUB decode into exactly the events the cache performed."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from fleet.cache import Cleared, Removed, Stored
from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, SimEngine, WorkerSpec
from fleet.kv_publisher import END_SEQ, KvEventPublisher


def decode_event(raw, encoding):
    """An independent reading of vLLM's two event encodings back into cache events."""

    def h(x):
        return int.from_bytes(x[-8:], "big") if isinstance(x, bytes) else x

    if encoding == "array":
        tag = raw[0]
        if tag == "BlockStored":
            assert len(raw) == 12 and raw[6] == "GPU"
            assert raw[8] == [None if raw[7] is None else [raw[7]]] * len(raw[1])  # extra_keys per block
            return Stored(tuple(map(h, raw[1])), None if raw[2] is None else h(raw[2]), tuple(raw[3]), raw[4],
                          raw[6], raw[5], raw[7])
        if tag == "BlockRemoved":
            return Removed(tuple(map(h, raw[1])), raw[2])
        assert raw == ["AllBlocksCleared"]
        return Cleared()
    tag = raw["type"]
    if tag == "BlockStored":
        assert {"lora_id", "medium", "lora_name"} <= raw.keys()
        parent = raw["parent_block_hash"]
        return Stored(tuple(map(h, raw["block_hashes"])), None if parent is None else h(parent),
                      tuple(raw["token_ids"]), raw["block_size"], raw["medium"], raw["lora_id"], raw["lora_name"])
    if tag == "BlockRemoved":
        return Removed(tuple(map(h, raw["block_hashes"])), raw["medium"])
    assert raw == {"type": "AllBlocksCleared"}
    return Cleared()


def subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def wait_joined(pub: KvEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops messages until the subscription has propagated: give it a moment."""
    time.sleep(0.3)


def recv_all(sub: zmq.Socket, n: int, timeout: float = 5.0) -> list[list[bytes]]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        if sub.poll(100):
            out.append(sub.recv_multipart())
    return out


def workload(eng: SimEngine, clock: VirtualClock) -> None:
    """Stores, hits, evictions (tiny cache) and a reset."""
    prompts = [list(range(1, 50)), list(range(1, 50)) + [7] * 20, [9] * 70, [3] * 40, list(range(1, 33))]
    for i, p in enumerate(prompts):
        lora = {"lora_name": "billing-v2", "lora_id": 1} if i == 2 else {}  # one on a LoRA adapter
        r = eng.execute(EngineRequest(f"r{i}", token_ids=p, max_tokens=1, **lora))
        clock.advance(r.e2e_s + 0.01)
        eng.tick()
    eng.reset_cache()
    r = eng.execute(EngineRequest("after", token_ids=[5] * 20, max_tokens=1))
    clock.advance(r.e2e_s + 0.01)
    eng.tick()


@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("hash_form", ["int", "bytes"])
def test_frames_decode_into_exactly_the_cache_events(encoding, hash_form):
    clock = VirtualClock()
    pub = KvEventPublisher(topic="kv@w0@sim-model", encoding=encoding, hash_form=hash_form)
    performed: list = []

    def on_events(events, ts):
        performed.extend(events)
        pub.publish(events, ts)

    eng = SimEngine(WorkerSpec("w0", num_gpu_blocks=8, block_size=16), clock, on_events)
    sub = subscribe(pub.endpoint, b"kv@")
    try:
        wait_joined(pub, sub)
        workload(eng, clock)
        assert pub.flush()
        msgs = recv_all(sub, pub.next_seq)
        assert len(msgs) == pub.next_seq > 0
        received = []
        for i, (topic, seq, payload) in enumerate(msgs):
            assert topic == b"kv@w0@sim-model"
            assert len(seq) == 8 and int.from_bytes(seq, "big") == i
            ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
            assert dp_rank == 0 and ts >= 1.8e9
            received.extend(decode_event(e, encoding) for e in events)
        assert received == performed
        kinds = {type(e) for e in performed}
        assert kinds == {Stored, Removed, Cleared}  # the workload covers evictions and a reset
        stored = [e for e in performed if isinstance(e, Stored)]
        assert all(len(e.token_ids) == 16 * len(e.hashes) for e in stored)
        assert stored[0].token_ids == tuple(range(1, 49))  # the tokens of exactly the stored blocks
        assert [(e.lora_name, e.lora_id) for e in stored if e.lora_name] == [("billing-v2", 1)]
        assert all(e.lora_id is None for e in stored if e.lora_name is None)
        assert all(0 <= h < 2**64 for e in stored for h in e.hashes)
        if hash_form == "bytes":
            _, events, _ = msgpack.unpackb(msgs[0][2], raw=False)
            first = events[0][1] if encoding == "array" else events[0]["block_hashes"]
            assert isinstance(first[0], bytes) and len(first[0]) == 32
    finally:
        sub.close(0)
        pub.close()


def replay(endpoint: str, start: int, shape: str, timeout: float = 5.0) -> list[tuple[int, bytes]]:
    """Ask the replay socket from ``start`` like a REQ client (DEALER + empty delimiter)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            assert frames[0] == b""
            body = frames[1:]
            if shape == "0.26":
                assert len(body) == 3
                topic, seq8, payload = body
                if seq8 == END_SEQ:
                    assert topic == b"" and payload == b""
                    return out
            else:
                assert len(body) == 2
                seq8, payload = body
                if seq8 == END_SEQ:
                    assert payload == b""
                    return out
            out.append((int.from_bytes(seq8, "big"), payload))
        raise AssertionError("no end marker from the replay socket")
    finally:
        sock.close(0)


@pytest.mark.parametrize("shape", ["0.26", "0.25"])
def test_replay_returns_exactly_the_batches_a_subscriber_missed(shape):
    clock = VirtualClock()
    pub = KvEventPublisher(replay_shape=shape)
    eng = SimEngine(WorkerSpec("w0", num_gpu_blocks=8, block_size=16), clock, pub.publish)
    sub = subscribe(pub.endpoint)
    try:
        wait_joined(pub, sub)
        workload(eng, clock)  # the first part: the subscriber is connected
        assert pub.flush()
        seen = recv_all(sub, pub.next_seq)
        first_missed = pub.next_seq
        sub.close(0)  # the subscriber goes away; the worker keeps publishing
        sent = {}
        for i in range(3):
            r = eng.execute(EngineRequest(f"late{i}", token_ids=[40 + i] * 33, max_tokens=1))
            clock.advance(r.e2e_s + 0.01)
            eng.tick()
        assert pub.flush()
        assert pub.next_seq > first_missed
        got = replay(pub.replay_endpoint, first_missed, shape)
        assert [s for s, _ in got] == list(range(first_missed, pub.next_seq))
        for s, payload in got:
            sent[s] = msgpack.unpackb(payload, raw=False)
            assert sent[s][1]  # every batch carries events
        # replaying from an earlier point returns the seen batches too, byte for byte
        again = replay(pub.replay_endpoint, 0, shape)
        assert [p for _, p in again[: len(seen)]] == [m[2] for m in seen]
    finally:
        sub.close(0)
        pub.close()


def test_dropped_batches_take_a_sequence_number_and_stay_replayable():
    clock = VirtualClock()
    eng = SimEngine(WorkerSpec("w0", block_size=16), clock)
    pub = KvEventPublisher(drop_share=lambda: eng.knobs.drop_kv_events, seed=1)
    eng.on_events = pub.publish
    sub = subscribe(pub.endpoint)
    try:
        wait_joined(pub, sub)
        eng.knobs.drop_kv_events = 0.5
        for i in range(20):
            r = eng.execute(EngineRequest(f"r{i}", token_ids=[i + 1] * 20, max_tokens=1))
            clock.advance(r.e2e_s + 0.01)
            eng.tick()
        assert pub.flush()
        got = recv_all(sub, pub.sent, timeout=3)
        seqs = [int.from_bytes(m[1], "big") for m in got]
        assert len(seqs) == pub.sent and 0 < pub.dropped < 20 and pub.sent + pub.dropped == 20
        missing = sorted(set(range(20)) - set(seqs))
        assert len(missing) == pub.dropped  # gaps in the sequence are exactly the drops
        replayed = dict(replay(pub.replay_endpoint, missing[0], "0.26"))
        assert set(missing) <= set(replayed)
    finally:
        sub.close(0)
        pub.close()


def test_a_simulated_fleet_publishes_the_words_of_every_stored_block(monkeypatch):
    """Pre-warmed tenant prompts and every routed request's blocks carry their token ids, so a
    worker's /detokenize names a branch by the text of its first block."""
    from fleet.router import Router
    from fleet.scenarios import load_preset
    from fleet.simulation import Simulation
    from fleet.tokenizer import decode
    from fleet.topology import load_topology

    seen: list[tuple[str, Stored]] = []
    on_kv_events = Router.on_kv_events

    def spy(self, worker, events, ts):
        seen.extend((worker, e) for e in events if isinstance(e, Stored))
        on_kv_events(self, worker, events, ts)

    monkeypatch.setattr(Router, "on_kv_events", spy)
    topo = load_topology()
    sim = Simulation(load_preset("healthy"), topo, duration_s=60)
    prewarm = len(seen)
    assert prewarm == 4 * len(topo.workers)  # one event per tenant per worker
    assert {decode(e.token_ids[:16]) for _, e in seen} == {
        "Acme billing ass", "Globex support a", "Hooli travel ass", "Initech legal as"}
    sim.run()
    routed = [e for _, e in seen[prewarm:]]
    assert routed and all(len(e.token_ids) == e.block_size * len(e.hashes) for e in routed)
    assert all(e.lora_name is None and e.lora_id is None for _, e in seen)
