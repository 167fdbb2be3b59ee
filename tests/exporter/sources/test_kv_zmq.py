"""The KV-event subscriber over real ZMQ sockets on 127.0.0.1.

The last test feeds the real ``ClusterState`` from the fleet's vLLM-format publisher.

``VllmLikePublisher`` speaks vLLM's framing: 3-frame messages on a PUB-compatible socket (an
XPUB, so the test can wait for the subscription instead of sleeping) and a ROUTER replay
socket that answers in the ≤ 0.25 or ≥ 0.26 reply shape.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from bench.cluster_subscriber import CountedRounds
from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    RouterSnapshot,
    WorkerSnapshot,
)
from exporter.sources.kv_zmq import END_SEQ, KvEndpoint, KvEventSubscriber
from fleet.cache import Removed, Stored
from fleet.kv_publisher import KvEventPublisher
from prefixscope.thresholds import load_thresholds
from tests.kv_publisher_process import script
from tests.support import free_port, wait_for

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TOKENS = list(range(16))


class RecordingSink:
    """A StateSink that keeps the applied batches and each worker's resident set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[KvBatch] = []
        self.restarts: list[str] = []
        self.resident: dict[str, set[int]] = {}
        self.repairs: list[tuple[str, str, bool]] = []  # (worker, reason, reliable)

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        with self.lock:
            self.batches.append(batch)
            blocks = self.resident.setdefault(batch.worker, set())
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    blocks.update(ev.hashes)
                elif isinstance(ev, BlockRemoved):
                    blocks.difference_update(ev.hashes)
                elif isinstance(ev, AllBlocksCleared):
                    blocks.clear()

    def worker_restarted(self, worker: str) -> None:
        with self.lock:
            self.restarts.append(worker)
            self.resident[worker] = set()

    def reset_view(self, worker: str) -> None:
        with self.lock:
            self.resident[worker] = set()

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        with self.lock:
            self.repairs.append((worker, reason, reliable))

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        pass

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        pass

    def ingest_records(self, records: list[dict], received_at: float) -> None:
        pass

    def seqs(self, worker: str) -> list[int]:
        with self.lock:
            return [b.seq for b in self.batches if b.worker == worker]


class VllmLikePublisher:
    def __init__(self, ctx: zmq.Context, topic: str = "kv@w@m", reply_shape: str = "0.26", answer: bool = True) -> None:
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind("tcp://127.0.0.1:0")
        self.reply_shape = reply_shape
        self.answer = answer
        self.buffer: dict[int, bytes] = {}
        self.truth: set[int] = set()
        self.seq = 0
        self.replay_requests: list[int] = []
        self.answering = threading.Event()  # cleared: replay requests wait (to stage a race)
        self.answering.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def endpoint(self, with_replay: bool = True) -> KvEndpoint:
        return KvEndpoint(self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          self.replay.getsockopt_string(zmq.LAST_ENDPOINT) if with_replay else None,
                          self.topic.decode())

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        assert self.pub.poll(int(timeout * 1000)), "no subscriber arrived"
        assert self.pub.recv()[:1] == b"\x01"

    def publish(self, events: list, *, send: bool = True, encoding: str = "map", raw: bytes | None = None) -> int:
        seq = self.seq
        self.seq += 1
        payload = raw if raw is not None else msgpack.packb([time.time(), [_encode(e, encoding) for e in events], 0])
        for e in events:
            if e[0] == "stored":
                self.truth.update(e[1])
            elif e[0] == "removed":
                self.truth.difference_update(e[1])
            else:
                self.truth.clear()
        self.buffer[seq] = payload
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """A new process: the sequence starts again at 0 and the cache is empty."""
        self.seq = 0
        self.buffer.clear()
        self.truth.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.replay.poll(50):
                continue
            ident, _, start8 = self.replay.recv_multipart()
            start = int.from_bytes(start8, "big")
            self.replay_requests.append(start)
            if not self.answer:
                continue
            while not self.answering.wait(0.05):
                if self._stop.is_set():
                    return
            for seq in sorted(s for s in self.buffer if s >= start):
                if self.reply_shape == "0.26":
                    self.replay.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), self.buffer[seq]])
                else:
                    self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            end = [b"", END_SEQ, b""] if self.reply_shape == "0.26" else [END_SEQ, b""]
            self.replay.send_multipart([ident, b"", *end])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.replay.close(0)


def _encode(event: tuple, encoding: str) -> object:
    kind, hashes, *rest = event
    if kind == "stored":
        parent = rest[0] if rest else None
        if encoding == "map":
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                    "token_ids": TOKENS * len(hashes), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
        return ["BlockStored", hashes, parent, TOKENS * len(hashes), 16, None, "GPU", None]
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"} if encoding == "map" \
            else ["BlockRemoved", hashes, "GPU"]
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


@pytest.fixture()
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _counters(health: Health) -> dict:
    """The counters that moved (every stream's gap and replay series exist from the start, at 0)."""
    out = {name: {k: v for k, v in series.items() if v} for name, series in health.snapshot()[0].items()}
    return {name: series for name, series in out.items() if series}


def _start(pubs: dict[str, VllmLikePublisher], sink: RecordingSink, health: Health, *, replay: bool = True,
           timeout: float = 1.0) -> KvEventSubscriber:
    sub = KvEventSubscriber({w: p.endpoint(replay) for w, p in pubs.items()}, sink, health,
                            replay_timeout=timeout, poll_interval=0.02)
    sub.start()
    assert sub.wait_connected()
    for p in pubs.values():
        p.wait_subscribed()
    assert sub.wait_started()  # the startup replays are done: what follows is live traffic
    return sub


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_in_order_batches_both_encodings(ctx: zmq.Context, encoding: str) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health)
    try:
        pub.publish([("stored", [1, 2]), ("stored", [3], 2)], encoding=encoding)
        pub.publish([("removed", [1]), ("stored", [2**64 - 5], 3)], encoding=encoding)
        pub.publish([("cleared", [])], encoding=encoding)
        pub.publish([("stored", [9])], encoding=encoding)
        wait_for(lambda: len(sink.seqs("w0")) == 4)
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0, 1, 2, 3]
    assert sink.batches[1].events == (BlockRemoved((1,), "GPU"), BlockStored((2**64 - 5,), 3, 16, 16, "GPU"))
    assert sink.resident["w0"] == pub.truth == {9}
    assert _counters(health) == {}  # no gap, no error (per-batch counts are the sink's)


@pytest.mark.parametrize("reply_shape", ["0.25", "0.26"])
def test_gap_is_replayed_in_order_and_no_block_is_lost(ctx: zmq.Context, reply_shape: str) -> None:
    pub, sink, health = VllmLikePublisher(ctx, reply_shape=reply_shape), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health)
    try:
        pub.publish([("stored", [1])])
        pub.publish([("stored", [2], 1)])
        pub.publish([("stored", [3], 2)], send=False)  # lost on the wire, kept in the replay buffer
        pub.publish([("removed", [1]), ("stored", [4], 3)], send=False)
        pub.publish([("stored", [5], 4)])
        pub.publish([("stored", [6], 5)])
        wait_for(lambda: len(sink.seqs("w0")) == 6)
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0, 1, 2, 3, 4, 5]
    assert sink.resident["w0"] == pub.truth == {2, 3, 4, 5, 6}
    assert pub.replay_requests == [0, 2]  # the (empty) startup replay, then the gap's
    c = _counters(health)
    assert c["prefixscope_kv_event_sequence_gaps"] == {("w0",): 1.0}
    assert c["prefixscope_kv_event_missed_batches"] == {("w0",): 2.0}
    assert c["prefixscope_kv_event_replays"] == {("w0", "recovered"): 1.0}


def test_partial_and_failed_replays(ctx: zmq.Context) -> None:
    pub, silent = VllmLikePublisher(ctx), VllmLikePublisher(ctx, answer=False)
    sink, health = RecordingSink(), Health()
    sub = _start({"w0": pub, "w1": silent}, sink, health, timeout=0.3)
    try:
        pub.publish([("stored", [1])])
        pub.publish([("stored", [2], 1)], send=False)
        pub.publish([("stored", [3], 2)], send=False)
        del pub.buffer[1]  # aged out of the worker's replay buffer
        pub.publish([("stored", [4], 3)])
        silent.publish([("stored", [7])])
        silent.publish([("stored", [8], 7)], send=False)
        silent.publish([("stored", [9], 8)])
        wait_for(lambda: len(sink.repairs) == 2 and sink.seqs("w0")[-1:] == [3] and sink.seqs("w1")[-1:] == [2])
    finally:
        sub.close()
        pub.close()
        silent.close()
    # w0: the gap's replay gave seq 2 but not 1; the view is rebuilt from what the buffer holds
    # (seq 0 and 2), which is not everything: it stays unreliable
    assert sink.seqs("w0") == [0, 0, 2, 3]
    assert sink.resident["w0"] == {1, 3, 4}  # block 2 is lost for good, and counted
    assert sink.seqs("w1")[0] == 0 and sink.seqs("w1")[-1] == 2  # its replay socket never answers
    assert sorted(sink.repairs) == [("w0", "lost_batches", False), ("w1", "lost_batches", False)]
    assert pub.replay_requests == [0, 1, 0]  # start, the gap, the rebuild
    c = _counters(health)
    assert c["prefixscope_kv_event_replays"] == {("w0", "partial"): 1.0, ("w1", "failed"): 1.0}
    assert c["prefixscope_kv_event_missed_batches"] == {("w0",): 2.0, ("w1",): 1.0}
    assert c["prefixscope_kv_event_lost_batches"] == {("w0",): 1.0, ("w1",): 1.0}


def test_gap_without_replay_endpoint_is_counted_only(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health, replay=False)
    try:
        pub.publish([("stored", [1])])
        pub.publish([("stored", [2], 1)], send=False)
        pub.publish([("stored", [3], 2)])
        wait_for(lambda: len(sink.seqs("w0")) == 2)
    finally:
        sub.close()
        pub.close()
    c = _counters(health)
    assert c["prefixscope_kv_event_missed_batches"] == {("w0",): 1.0}
    assert c["prefixscope_kv_event_lost_batches"] == {("w0",): 1.0}  # nothing can heal it
    assert sink.repairs == [("w0", "lost_batches", False)]  # the view is kept, marked unreliable
    assert "prefixscope_kv_event_replays" not in health.snapshot()[0] and pub.replay_requests == []


def test_restart_clears_the_view(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health)
    try:
        for h in (1, 2, 3):
            pub.publish([("stored", [h])])
        wait_for(lambda: len(sink.seqs("w0")) == 3)
        pub.restart()
        pub.publish([("stored", [10])])
        wait_for(lambda: len(sink.seqs("w0")) == 4)
    finally:
        sub.close()
        pub.close()
    assert sink.restarts == ["w0"]
    assert sink.resident["w0"] == {10}
    assert sink.seqs("w0") == [0, 1, 2, 0]
    assert "prefixscope_kv_event_sequence_gaps" not in _counters(health)


def test_late_join_replays_from_zero_without_counting_a_gap(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    for h in (1, 2, 3):  # published before anyone listened
        pub.publish([("stored", [h])], send=False)
    sub = _start({"w0": pub}, sink, health)
    try:
        pub.publish([("stored", [4])])
        wait_for(lambda: len(sink.seqs("w0")) == 4)
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0, 1, 2, 3]
    assert sink.resident["w0"] == {1, 2, 3, 4}
    assert pub.replay_requests == [0]
    c = _counters(health)
    assert "prefixscope_kv_event_sequence_gaps" not in c and "prefixscope_kv_event_replays" not in c


def test_garbage_frames_and_payloads_are_counted(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health)
    try:
        pub.publish([("stored", [1])])
        pub.pub.send_multipart([pub.topic, b"only two frames"])
        pub.pub.send_multipart([pub.topic, b"\x00\x01", b"short seq"])
        pub.publish([], raw=b"\xc1 not msgpack")  # seq 1: received, undecodable
        pub.publish([], raw=(FIXTURES / "kv_unknown_event.msgpack").read_bytes())  # seq 2
        pub.publish([("stored", [2], 1)])  # seq 3
        wait_for(lambda: len(sink.seqs("w0")) == 3)
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0, 2, 3]
    errors = _counters(health)["prefixscope_ingest_errors"]
    assert errors == {("kv_events", "frame"): 2.0, ("kv_events", "decode"): 1.0, ("kv_events", "unknown_event"): 1.0}
    assert "prefixscope_kv_event_sequence_gaps" not in _counters(health)


def test_close_stops_promptly_without_traffic(ctx: zmq.Context) -> None:
    pub = VllmLikePublisher(ctx)
    sub = _start({"w0": pub}, RecordingSink(), Health())
    sub.close()  # waits for its thread at most 5 s, then gives up and leaves it running
    pub.close()
    # Stopped, not abandoned: the thread wakes from its 20 ms poll without any traffic.
    assert sub._thread is not None and not sub._thread.is_alive()


# ---- with the real state and the fleet's publisher -------------------------------------------
@pytest.mark.parametrize(("encoding", "replay_shape", "hash_form"),
                         [("map", "0.26", "int"), ("array", "0.25", "bytes")])
def test_dropped_batches_recovered_and_restart_clears_the_view(encoding: str, replay_shape: str, hash_form: str) -> None:
    health = Health()
    state = ClusterState.build(health, load_thresholds())
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    drop = {"on": False}

    def publisher() -> KvEventPublisher:
        # ZMQ releases a closed socket's port asynchronously: retry the rebind until it is free
        return wait_for(lambda: KvEventPublisher(pub_ep, replay_ep, encoding=encoding, replay_shape=replay_shape,
                                                 hash_form=hash_form, drop_share=lambda: 1.0 if drop["on"] else 0.0),
                        "the publisher's ports to be free again", ignore=(RuntimeError,))

    pub = publisher()
    sub = KvEventSubscriber({"w0": KvEndpoint(pub_ep, replay_ep)}, state, health, replay_timeout=1.0, poll_interval=0.02)
    sub.start()
    truth: set[int] = set()
    try:
        assert sub.wait_connected()
        time.sleep(0.2)  # let the subscription reach the PUB socket (a loss here is recovered anyway)
        parent = None
        for i in range(1, 11):
            drop["on"] = i in (4, 5, 6)
            events = [Stored((i * 10, i * 10 + 1), parent, (), 16)]
            truth.update((i * 10, i * 10 + 1))
            if i == 8:
                events.append(Removed((20,)))
                truth.discard(20)
            pub.publish(events, time.time())
            assert pub.flush()
            parent = i * 10 + 1
        wait_for(lambda: state.index.resident_blocks("w0") == len(truth))
        assert all(state.index.holds("w0", h) for h in truth)
        counters = _counters(health)
        assert counters["prefixscope_kv_event_missed_batches"] == {("w0",): 3.0}
        assert counters["prefixscope_kv_event_replays"] == {("w0", "recovered"): 1.0}
        assert counters["prefixscope_kv_event_batches"] == {("w0",): 10.0}
        # healed: counted, nothing lost, no repair, step 0 clear
        assert "prefixscope_kv_event_lost_batches" not in counters and "prefixscope_kv_index_repairs" not in counters
        assert evaluate(state).results["kv_event_gaps"].status == "ok"

        pub.close()  # the worker restarts: a new process, an empty cache, seq from 0 again
        drop["on"] = False
        pub = publisher()
        def republished() -> bool:  # retried until the SUB reconnects
            if state.index.resident_blocks("w0") == 1:
                return True
            pub.publish([Stored((999,), None, (), 16)], time.time())
            pub.flush()
            return False

        wait_for(republished, "the restarted worker's first block", every=0.1)
        assert state.index.resident_blocks("w0") == 1 and state.index.holds("w0", 999)
        assert health.snapshot()[0]["prefixscope_worker_restarts"] == {("w0",): 1.0}
    finally:
        sub.close()
        pub.close()


# ---- the startup replay --------------------------------------------------------------------------
def _fleet_publisher(pub_ep: str, replay_ep: str) -> KvEventPublisher:
    """The fleet's vLLM-format publisher on fixed ports (a restarted worker binds them again)."""
    for _ in range(50):  # the previous process's sockets may still be closing
        try:
            return KvEventPublisher(pub_ep, replay_ep)
        except RuntimeError:
            time.sleep(0.05)
    raise AssertionError("could not bind the publisher's endpoints")


def _resident(state: ClusterState, worker: str) -> set[int]:
    return set(state.index.blocks_of(worker))


def test_idle_worker_is_fully_known_after_start() -> None:
    health = Health()
    state = ClusterState.build(health, load_thresholds())
    busy = KvEventPublisher()
    silent = KvEventPublisher()  # has a replay socket, never published
    try:
        # Published before the exporter started, then idle: only the replay can tell.
        busy.publish([Stored((1, 2, 3), None, (), 16)], 1.0)
        busy.publish([Stored((4,), 2, (), 16), Removed((3,))], 2.0)
        busy.publish([Stored((5, 6), 4, (), 16)], 3.0)
        assert busy.flush()
        sub = KvEventSubscriber({"w0": KvEndpoint(busy.endpoint, busy.replay_endpoint),
                                 "w1": KvEndpoint(silent.endpoint, silent.replay_endpoint)},
                                state, health, replay_timeout=1.0, poll_interval=0.02)
        with sub:
            assert sub.wait_started()
            assert _resident(state, "w0") == {1, 2, 4, 5, 6}
            assert state.index.resident_blocks("w1") is None  # nothing to learn: still unknown
            assert sub.replayed_at_start == {"w0": 2}
    finally:
        busy.close()
        silent.close()
    c = _counters(health)
    assert c["prefixscope_kv_event_batches"] == {("w0",): 3.0}
    assert health.snapshot()[0]["prefixscope_worker_restarts"] == {("w0",): 0.0}
    assert "prefixscope_kv_event_sequence_gaps" not in c and "prefixscope_ingest_errors" not in c


def test_live_batches_racing_the_startup_replay_are_applied_once(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    pub.publish([("stored", [1])], send=False)  # before the exporter started
    pub.answering.clear()  # the worker is slow to answer the startup replay ...
    sub = KvEventSubscriber({"w0": pub.endpoint()}, sink, health, replay_timeout=2.0, poll_interval=0.02)
    sub.start()
    try:
        assert sub.wait_connected()
        pub.wait_subscribed()
        wait_for(lambda: pub.replay_requests == [0])
        for h in (2, 3):  # ... and publishes live meanwhile: seqs 1, 2 arrive live and in the replay
            pub.publish([("stored", [h], h - 1)])
        pub.answering.set()
        assert sub.wait_started()
        pub.publish([("stored", [4], 3)])  # seq 3: the first live batch past the replay
        wait_for(lambda: len(sink.seqs("w0")) == 4)
        time.sleep(0.1)  # a double application would have landed by now
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0, 1, 2, 3]
    assert sink.restarts == [] and sink.resident["w0"] == {1, 2, 3, 4}
    assert sub.replayed_at_start == {"w0": 2}
    c = _counters(health)
    assert "prefixscope_kv_event_sequence_gaps" not in c and "prefixscope_kv_event_replays" not in c


def test_restart_after_the_startup_replay_is_still_detected(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    for h in (1, 2, 3):
        pub.publish([("stored", [h])], send=False)
    sub = _start({"w0": pub}, sink, health)  # replayed seq 0..2 at start
    try:
        pub.restart()
        pub.publish([("stored", [10])])  # seq 0 again, other content: a new process
        wait_for(lambda: len(sink.seqs("w0")) == 4)
        pub.publish([("stored", [11], 10)])
        wait_for(lambda: len(sink.seqs("w0")) == 5)
    finally:
        sub.close()
        pub.close()
    assert sink.restarts == ["w0"]
    assert sink.resident["w0"] == {10, 11}
    assert sink.seqs("w0") == [0, 1, 2, 0, 1]


def test_fleet_publisher_restart_after_start_clears_the_rebuilt_view() -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    health = Health()
    state = ClusterState.build(health, load_thresholds())
    pub = _fleet_publisher(pub_ep, replay_ep)
    for h in (1, 2, 3, 4):
        pub.publish([Stored((h,), h - 1 if h > 1 else None, (), 16)], float(h))
    assert pub.flush()
    sub = KvEventSubscriber({"w0": KvEndpoint(pub_ep, replay_ep)}, state, health, replay_timeout=1.0,
                            poll_interval=0.02)
    try:
        sub.start()
        assert sub.wait_started()
        assert _resident(state, "w0") == {1, 2, 3, 4} and sub.replayed_at_start == {"w0": 3}
        pub.close()
        pub = _fleet_publisher(pub_ep, replay_ep)  # the worker restarts: seq 0, an empty cache
        time.sleep(0.3)  # let the SUB socket reconnect; a batch lost meanwhile is resent below

        def republished() -> bool:  # resent until the reconnected SUB sees it
            if _resident(state, "w0") == {20}:
                return True
            pub.publish([Stored((20,), None, (), 16)], 9.0)  # seq stays below the mark (3)
            assert pub.flush()
            return False

        wait_for(republished, "the restarted worker's block", every=0.25)
    finally:
        sub.close()
        pub.close()
    assert _resident(state, "w0") == {20}
    assert _counters(health)["prefixscope_worker_restarts"] == {("w0",): 1.0}


# ---- hostile or broken streams ---------------------------------------------------------------------
@pytest.mark.parametrize("configured", ["", "kv@w", "kv@w@m2"])
def test_topic_must_match_exactly(ctx: zmq.Context, configured: str) -> None:
    pub, sink, health = VllmLikePublisher(ctx, topic="kv@w@m"), RecordingSink(), Health()
    ep = pub.endpoint(with_replay=False)
    sub = KvEventSubscriber({"w0": KvEndpoint(ep.pub, None, configured)}, sink, health, poll_interval=0.02)
    sub.start()
    try:
        assert sub.wait_connected()
        pub.wait_subscribed()
        assert sub.wait_started()
        pub.publish([("stored", [1])])  # another topic that the prefix subscription may let through
        pub.pub.send_multipart([configured.encode(), (0).to_bytes(8, "big"),
                                msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [7], "block_size": 16}], 0])])
        wait_for(lambda: len(sink.seqs("w0")) == 1)
    finally:
        sub.close()
        pub.close()
    assert sink.resident["w0"] == {7}  # only the exact topic's message
    errors = _counters(health).get("prefixscope_ingest_errors", {})
    assert errors == ({} if configured == "kv@w@m2" else {("kv_events", "topic"): 1.0})


@pytest.mark.parametrize("seq8", [b"\xff" * 8, b"\x9c\x41\x07\x88\x12\x00\xab\x3e", ((1 << 40) + 1).to_bytes(8, "big")])  # expected 1: a jump of 2^40
def test_an_impossible_sequence_number_costs_only_its_message(ctx: zmq.Context, seq8: bytes) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health)
    try:
        pub.publish([("stored", [1])])
        pub.pub.send_multipart([pub.topic, seq8, msgpack.packb([1.0, [], 0])])
        pub.publish([("stored", [2], 1)])
        wait_for(lambda: len(sink.seqs("w0")) == 2)
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0, 1] and sink.restarts == [] and sink.resident["w0"] == {1, 2}
    c = _counters(health)
    assert c["prefixscope_ingest_errors"] == {("kv_events", "sequence"): 1.0}
    assert "prefixscope_kv_event_missed_batches" not in c and "prefixscope_kv_event_sequence_gaps" not in c


def test_first_message_with_an_impossible_sequence_number_is_dropped(ctx: zmq.Context) -> None:
    pub, sink, health = VllmLikePublisher(ctx), RecordingSink(), Health()
    sub = _start({"w0": pub}, sink, health, replay=False)
    try:
        pub.pub.send_multipart([pub.topic, b"\x80" + b"\x00" * 7, msgpack.packb([1.0, [], 0])])
        pub.publish([("stored", [1])])
        wait_for(lambda: len(sink.seqs("w0")) == 1)
    finally:
        sub.close()
        pub.close()
    assert sink.seqs("w0") == [0]
    assert _counters(health)["prefixscope_ingest_errors"] == {("kv_events", "sequence"): 1.0}


def test_a_slow_replay_delays_only_its_own_worker(ctx: zmq.Context) -> None:
    slow, healthy = VllmLikePublisher(ctx), VllmLikePublisher(ctx)
    sink, health = RecordingSink(), Health()
    sub = _start({"slow": slow, "ok": healthy}, sink, health, timeout=30.0)  # the slow replay must be released
    try:
        slow.publish([("stored", [1])])
        wait_for(lambda: sink.seqs("slow") == [0])
        slow.answering.clear()  # from now on its replay endpoint does not answer
        slow.publish([("stored", [2], 1)], send=False)  # lost: seq 2 reveals the gap, its replay hangs
        slow.publish([("stored", [3], 2)])
        wait_for(lambda: len(slow.replay_requests) == 2)
        slow.publish([("stored", [4], 3)])  # waits behind the replay, in order
        for h in (10, 11, 12):
            healthy.publish([("stored", [h])])
        wait_for(lambda: len(sink.seqs("ok")) == 3)  # the healthy worker is not held up ...
        assert sink.seqs("slow") == [0]  # ... while the slow one's replay is still out
        assert "prefixscope_kv_event_replays" not in _counters(health)
        slow.answering.set()
        wait_for(lambda: len(sink.seqs("slow")) == 4)
    finally:
        sub.close()
        slow.close()
        healthy.close()
    assert sink.seqs("slow") == [0, 1, 2, 3] and sink.resident["slow"] == {1, 2, 3, 4}
    assert sink.seqs("ok") == [0, 1, 2]
    assert _counters(health)["prefixscope_kv_event_replays"] == {("slow", "recovered"): 1.0}


def test_close_does_not_wait_for_a_silent_replay(ctx: zmq.Context) -> None:
    silent = VllmLikePublisher(ctx)
    sink, health = RecordingSink(), Health()
    sub = _start({"w0": silent}, sink, health, timeout=30.0)
    silent.answering.clear()
    try:
        silent.publish([("stored", [1])], send=False)
        silent.publish([("stored", [2], 1)])
        wait_for(lambda: len(silent.replay_requests) == 2)
    finally:
        started = time.monotonic()
        sub.close()
        silent.close()
    assert time.monotonic() - started < 5.0  # not the 30 s replay timeout
    assert all(not t.is_alive() for t in sub._replay_threads.values())


def test_startup_replays_beyond_the_concurrent_limit_are_all_taken(ctx: zmq.Context,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Startup replays run a few at a time (each holds a socket): every worker's buffer is still
    # replayed once, in seq order, when there are more workers than replays in flight.
    import exporter.sources.kv_zmq as kv_zmq

    monkeypatch.setattr(kv_zmq, "MAX_STARTUP_REPLAYS", 2)
    pubs = {f"w{i}": VllmLikePublisher(ctx) for i in range(5)}
    for i, pub in enumerate(pubs.values()):
        pub.publish([("stored", [100 * i + 1])], send=False)
        pub.publish([("stored", [100 * i + 2], 100 * i + 1)], send=False)
    sink, health = RecordingSink(), Health()
    sub = KvEventSubscriber({w: p.endpoint() for w, p in pubs.items()}, sink, health, replay_timeout=2.0,
                            poll_interval=0.02)
    sub.start()
    try:
        assert sub.wait_connected() and sub.wait_started()
    finally:
        sub.close()
        for pub in pubs.values():
            pub.close()
    assert {w: sink.seqs(w) for w in pubs} == {w: [0, 1] for w in pubs}
    assert all(p.replay_requests == [0] for p in pubs.values())
    assert sub.replayed_at_start == {w: 1 for w in pubs}


# A worker in a process of its own (tests.kv_publisher_process): each batch stores BLOCKS new blocks.
_PUBLISHER = script(r"""
TOPIC, BLOCKS = b"kv@w@m", int(sys.argv[1])
def numbered(seq):
    pass
def payload(seq):
    hashes = [(seq << 20) + i for i in range(BLOCKS)]
    return msgpack.packb([1.8e9 + seq, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
        "token_ids": [seq % 100] * (16 * BLOCKS), "block_size": 16, "lora_id": None, "medium": "GPU"}], 0])
""")


def _peak_rss_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        return True
    except OSError:
        return False


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_a_subscriber_that_falls_behind_holds_a_bounded_backlog_and_the_replay_heals_the_gap() -> None:
    """The state stalls while a worker publishes ~120 MB of batches. What the subscriber holds meanwhile
    is its bounded receive queue (a few of them), not the backlog; the rest is a gap, counted as
    missed batches and healed by the worker's replay as soon as the next batch shows it."""
    import subprocess
    import sys

    blocks, published = 4096, 1200  # ~100 KB a batch (hashes and token ids, as vLLM sends them)
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(blocks)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    gate = threading.Event()

    class StalledSink(RecordingSink):
        def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
            gate.wait(60)  # the state is stalled (a long lock hold, a core too busy) until released
            super().apply_kv_batch(batch, received_at)

    sink, health = StalledSink(), Health()
    pub_ep, replay_ep = proc.stdout.readline().split()
    sub = KvEventSubscriber({"w0": KvEndpoint(pub_ep, replay_ep, "kv@w@m")}, sink, health,
                            replay_timeout=5.0, poll_interval=0.02, queue_messages=16)
    try:
        sub.start()
        assert sub.wait_connected() and sub.wait_started()
        import gc
        gc.collect()
        measured = _peak_rss_reset()
        before = _rss("VmRSS")
        proc.stdin.write(f"publish {published}\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) == published
        time.sleep(1.0)  # what is in flight arrives (no budget: the bound is on memory, not time)
        grown = _rss("VmHWM" if measured else "VmRSS") - before
        gate.set()

        def next_batch_shows_the_gap() -> bool:  # (a batch sent while the worker's queue is full is dropped too)
            nonlocal published
            proc.stdin.write("publish 1\n")
            proc.stdin.flush()
            published = int(proc.stdout.readline())
            return bool(health.counters.get("prefixscope_kv_event_sequence_gaps", {}).get(("w0",)))

        wait_for(next_batch_shows_the_gap, every=0.2, timeout=120)
        wait_for(lambda: len(sink.seqs("w0")) == published, timeout=120)
    finally:
        gate.set()
        sub.close()
        proc.kill()
        proc.wait()
    # ~120 MB published; ZMQ's default queue (1,000 messages) would have held ~100 MB of it.
    assert grown < 32 * 1024 * 1024, f"the subscriber grew by {grown / 1e6:.0f} MB while stalled"
    assert sink.seqs("w0") == list(range(published))  # every batch applied once, in order
    c = _counters(health)
    missed = c["prefixscope_kv_event_missed_batches"][("w0",)]
    assert missed >= 1200 - 300, c  # most of the backlog became a gap ...
    assert c["prefixscope_kv_event_replays"] == {("w0", "recovered"): c["prefixscope_kv_event_sequence_gaps"][("w0",)]}
    assert "prefixscope_kv_event_lost_batches" not in c  # ... and the replay healed all of it


def test_many_workers_bursts_are_drained_in_rounds_each_in_its_own_order(ctx: zmq.Context,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ready socket is read until empty in one round, so a burst over many workers costs a few
    polls, not one per message; rounds are spaced by the sockets followed (a poll's cost), capped."""
    import exporter.sources.kv_zmq as kv_zmq

    pubs = {f"w{i}": VllmLikePublisher(ctx) for i in range(12)}
    sink, health = RecordingSink(), Health()
    sub = _start(pubs, sink, health)
    rounds: list[int] = []
    monkeypatch.setattr(sub, "_rounds", CountedRounds(sub._rounds, lambda ready: rounds.append(len(ready)) if ready else None))
    per_worker = 40
    try:
        assert sub.round_gap_s == pytest.approx(12 * kv_zmq.ROUND_GAP_PER_SOCKET_S)
        for i in range(per_worker):
            for w, pub in pubs.items():
                pub.publish([("stored", [1000 * int(w[1:]) + i], None if i == 0 else 1000 * int(w[1:]) + i - 1)])
        wait_for(lambda: all(len(sink.seqs(w)) == per_worker for w in pubs))
    finally:
        sub.close()
        for pub in pubs.values():
            pub.close()
    assert {w: sink.seqs(w) for w in pubs} == {w: list(range(per_worker)) for w in pubs}
    assert all(sink.resident[w] == pub.truth for w, pub in pubs.items())
    assert len(rounds) < len(pubs) * per_worker  # several messages a round, not a poll each
    assert _counters(health) == {}
    monkeypatch.setattr(kv_zmq, "ROUND_GAP_PER_SOCKET_S", kv_zmq.MAX_ROUND_GAP_S)  # as if thousands were followed
    sub._set_round_gap()
    assert sub.round_gap_s == kv_zmq.MAX_ROUND_GAP_S  # capped: at most this much added to the lag


def test_replays_after_start_fetch_a_bounded_number_at_once_and_the_rest_wait_their_turn(
        ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every worker has a gap at once (a subscriber that fell behind sheds on all of them), the
    replays' fetched batches are held a few workers at a time; each gap is still healed, in order."""
    import exporter.sources.kv_zmq as kv_zmq

    monkeypatch.setattr(kv_zmq, "MAX_REPLAYS", 1)
    pubs = {f"w{i}": VllmLikePublisher(ctx) for i in range(3)}
    sink, health = RecordingSink(), Health()
    sub = _start(pubs, sink, health, timeout=5.0)
    try:
        for i, pub in enumerate(pubs.values()):
            pub.publish([("stored", [10 * i])])
        wait_for(lambda: all(len(sink.seqs(w)) == 1 for w in pubs))
        pubs["w0"].answering.clear()  # w0's replay holds the only slot until it answers
        for i, pub in enumerate(pubs.values()):
            pub.publish([("stored", [10 * i + 1], 10 * i)], send=False)  # lost on the wire, kept for the replay
            pub.publish([("stored", [10 * i + 2], 10 * i + 1)])
        wait_for(lambda: pubs["w0"].replay_requests == [0, 1])
        time.sleep(0.5)  # the others' fetches wait for the slot: nothing asked of their workers yet
        assert [pubs[w].replay_requests for w in ("w1", "w2")] == [[0], [0]]
        pubs["w0"].answering.set()
        wait_for(lambda: all(len(sink.seqs(w)) == 3 for w in pubs))
    finally:
        pubs["w0"].answering.set()
        sub.close()
        for pub in pubs.values():
            pub.close()
    assert {w: sink.seqs(w) for w in pubs} == {w: [0, 1, 2] for w in pubs}
    assert all(sink.resident[w] == pub.truth for w, pub in pubs.items())
    assert _counters(health)["prefixscope_kv_event_replays"] == {(w, "recovered"): 1.0 for w in pubs}


class FullSink(RecordingSink):
    """A sink whose index is full: every batch that stores a block fails, as past the index's capacity."""

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        if any(isinstance(ev, BlockStored) for ev in batch.events):
            raise MemoryError("prefix index: more than 2^27 blocks")
        super().apply_kv_batch(batch, received_at)


def test_a_failing_apply_is_counted_every_time_and_logged_once(ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    pub, sink, health = VllmLikePublisher(ctx), FullSink(), Health()
    sub = _start({"w0": pub}, sink, health, replay=False)
    try:
        for i in range(5):
            pub.publish([("stored", [i + 1])])
        pub.publish([("removed", [1])])
        wait_for(lambda: len(sink.seqs("w0")) == 1)
    finally:
        sub.close()
        pub.close()
    assert _counters(health)["prefixscope_ingest_errors"] == {("kv_events", "apply"): 5.0}
    tracebacks = [r for r in caplog.records if r.getMessage().endswith("applying KV events failed") and r.exc_info]
    assert len(tracebacks) == 1  # the stream goes on; the log is not flooded once per batch
