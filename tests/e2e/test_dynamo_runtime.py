"""NVIDIA Dynamo's own runtime publishing KV events through a real nats-server, followed exactly.

The publishers are the ``ai-dynamo-runtime`` wheels from PyPI (the current release and the 1.0
line, one ``.peers`` venv each, ``make peers``), driven by ``tests/e2e/dynamo_peer.py``: a
``KvEventPublisher`` per data-parallel rank, fed through its own Python API or relaying what a
vLLM engine publishes on ZMQ (frames as vLLM's publisher sends them, every medium). The exporter
subscribes to Dynamo's default subjects (``kv_nats.dynamo`` with no worker list) and must end with
exactly the workers, resident blocks per medium, tree edges and counters that were published.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from exporter.bootstrap import ExporterParts, bootstrap, build_nats_source
from exporter.codecs.dynamo_events import worker_name
from exporter.config import Config, NatsKv, dynamo_subjects
from exporter.sources.kv_nats import NatsKvSource
from tests.support import free_port, read_until, require_peer_python, require_tool, wait_for

pytestmark = pytest.mark.slow

PEER = Path(__file__).resolve().parent / "dynamo_peer.py"
BLOCK = 4
# The current release publishes batches on the endpoint-scoped subject; 1.0 one event per message
# on the component-scoped one (its event plane needs the worker-local indexer; without it, 1.0
# writes bare JSON to its legacy JetStream stream's subject).
RUNTIMES = {
    "1.6.1": {"local_indexer": False},
    "1.0.2": {"local_indexer": True},
    "1.0.2-jetstream": {"local_indexer": False},
}
LEGACY_SUBJECT = "namespace-demo-component-backend-kv-events.kv-events"


def tokens(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BLOCK))


# rank 0: a chain of four blocks, the last one removed again; rank 1: a chain of two
API_STEPS = {
    "0": [{"stored": {"tokens": tokens(0, 2), "hashes": [101, 102]}},
          {"stored": {"tokens": tokens(8, 1), "hashes": [103], "parent": 102}},
          {"stored": {"tokens": tokens(12, 2), "hashes": [104, 105], "parent": 103}},
          {"removed": [105]}],
    "1": [{"stored": {"tokens": tokens(100, 1), "hashes": [201]}},
          {"stored": {"tokens": tokens(104, 1), "hashes": [202], "parent": 201}}],
}


@dataclass
class Nats:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Nats]:
    binary = require_tool("nats-server")
    port = free_port()
    proc = subprocess.Popen([binary, "-js", "-sd", str(tmp_path / "js"), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(up, what="nats-server listening")
        yield Nats(proc, port)
    finally:
        proc.kill()
        proc.wait(10)


@dataclass
class Exporter:
    parts: ExporterParts
    source: NatsKvSource

    @property
    def index(self) -> Any:
        return self.parts.state.index

    def counter(self, name: str) -> dict[tuple[str, ...], float]:
        """An exported counter's series (what /metrics renders), by label values."""
        return dict(self.parts.state.series().counters.get(name, {}))

    def close(self) -> None:
        self.source.close()


@pytest.fixture
def exporter(nats_server: Nats) -> Iterator[Exporter]:
    """An exporter reading Dynamo's default subjects (every namespace, both event-plane forms) and
    1.0's legacy subject, with no worker list."""
    cfg = Config(source="test", kv_nats=NatsKv(url=nats_server.url, dynamo_subjects=(*dynamo_subjects(), LEGACY_SUBJECT),
                                                dynamo_block_size=BLOCK))
    parts = bootstrap(cfg)
    source = build_nats_source(cfg, (), parts.state, parts.health)
    assert source is not None
    source.start()
    assert source.wait_started()
    exp = Exporter(parts, source)
    try:
        yield exp
    finally:
        exp.close()


class Peer:
    """One Dynamo worker process (one runtime, one publisher per rank)."""

    def __init__(self, runtime: str, plan: dict[str, Any], nats: Nats, tmp: Path) -> None:
        python = require_peer_python("dynamo-" + runtime.split("-")[0])
        plan = {"endpoint": "demo.backend.generate", "block_size": BLOCK,
                "local_indexer": RUNTIMES[runtime]["local_indexer"], **plan}
        env = {**os.environ, "NATS_SERVER": nats.url, "DYN_DISCOVERY_BACKEND": "file",
               "DYN_FILE_KV": str(tmp / "discovery"), "DYN_EVENT_PLANE": "nats", "DYN_LOG": "warn"}
        self.log_path = tmp / f"peer-{runtime}-{time.monotonic_ns()}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen([str(python), str(PEER), json.dumps(plan)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        assert self.proc.stdout is not None
        self.seen: list[str] = []
        self.worker_id = int(read_until(self.proc.stdout, r"^ready (\d+)", self.seen).group(1))

    def published(self) -> None:
        assert self.proc.stdout is not None
        read_until(self.proc.stdout, r"^published", self.seen)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def media(exp: Exporter) -> dict[str, dict[str, int]]:
    """worker -> medium -> resident blocks (the media it holds blocks on)."""
    return {w: {k: n for k, n in m.items() if n} for w, m in exp.index.resident_by_medium().items()}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_the_api_publisher_is_followed_exactly(runtime: str, exporter: Exporter, nats_server: Nats,
                                               tmp_path: Path) -> None:
    peer = Peer(runtime, {"ranks": API_STEPS}, nats_server, tmp_path)
    try:
        peer.published()
        w0, w1 = worker_name(peer.worker_id), worker_name(peer.worker_id, 1)
        expected = {w0: {"GPU": 4}, w1: {"GPU": 2}}
        wait_for(lambda: media(exporter) == expected, what="the published blocks")
    finally:
        peer.stop()
    index = exporter.index
    assert sorted(index.workers) == sorted((w0, w1))
    assert sorted(index.blocks_of(w0)) == [101, 102, 103, 104] and sorted(index.blocks_of(w1)) == [201, 202]
    # the tree: each stored block hangs under the parent it was published with
    assert [index.parent(b) for b in (101, 102, 103, 104, 201, 202)] == [None, 101, 102, 103, None, 201]
    assert index.holders(101) == [w0] and index.holders(201) == [w1] and not index.holders(105)
    # counters: 3 + 2 stores (6 + 2 blocks) and one removal applied; no gap, no error, no restart
    applied = exporter.counter("prefixscope_kv_events_applied")
    assert applied[(w0, "BlockStored")] == 3 and applied[(w0, "BlockRemoved")] == 1 and applied[(w1, "BlockStored")] == 2
    assert exporter.counter("prefixscope_kv_blocks_stored") == {(w0,): 5, (w1,): 2}
    assert set(exporter.counter("prefixscope_kv_event_sequence_gaps").values()) == {0}
    assert exporter.counter("prefixscope_ingest_errors") == {}
    assert set(exporter.counter("prefixscope_worker_restarts").values()) == {0}


def vllm_batch(ts: float, events: list[Any], dp_rank: int = 0) -> bytes:
    """One ZMQ payload as vLLM ≥ 0.24's publisher sends it: ``[ts, events, dp_rank]``, events as maps."""
    return msgpack.packb([ts, events, dp_rank])


def stored(hashes: list[int], medium: str, parent: int | None = None, first: int = 0) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens(first, len(hashes)), "block_size": BLOCK, "lora_id": None, "medium": medium,
            "lora_name": None}


# A GPU chain, its offload to CPU, a disk (STORAGE) tier copy and an external one, a CPU eviction,
# and rank 1's own GPU block; one batch in vLLM ≤ 0.23's array encoding.
ZMQ_BATCHES = [
    (0, [stored([301, 302], "GPU"), stored([303], "GPU", 302, 8)]),
    (0, [stored([301, 302], "CPU"), stored([303], "CPU", 302, 8)]),
    (0, [stored([301], "STORAGE")]),
    (0, [stored([304], "EXTERNAL", 303, 12)]),
    (0, [{"type": "BlockRemoved", "block_hashes": [303], "medium": "CPU"}]),
    (1, [["BlockStored", [401], None, tokens(50, 1), BLOCK, None, "GPU", None, [None], 0, "full_attention", None]]),
]
# What each runtime publishes of them. 1.6 names each event's tier and relays both encodings;
# 1.0's RouterEvent has no tier, so every medium's store and removal arrives as the GPU's (the CPU
# removal of 303 takes it off the GPU tier too), and its relay does not decode the array-encoded batch.
ZMQ_EXPECTED = {"1.6.1": {"": {"GPU": 4, "CPU": 2, "STORAGE": 1, "EXTERNAL": 1}, "-dp1": {"GPU": 1}},
                "1.0.2": {"": {"GPU": 4}}}


@pytest.mark.parametrize("runtime", ["1.6.1", "1.0.2"])
def test_relayed_vllm_events_keep_every_tier(runtime: str, exporter: Exporter, nats_server: Nats,
                                             tmp_path: Path) -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    peer = Peer(runtime, {"zmq": {"0": f"tcp://127.0.0.1:{port}"}}, nats_server, tmp_path)
    seq = 0

    def send(events: list[Any], dp_rank: int = 0) -> None:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), vllm_batch(time.time(), events, dp_rank)])
        seq += 1

    try:
        w0 = worker_name(peer.worker_id)
        # ZMQ drops what is sent before the subscriber joins: repeat a probe block until it lands
        # (it stays: Dynamo's publisher counts the repeated stores and would publish a removal only
        # after as many removals)
        wait_for(lambda: send([stored([999], "GPU")]) or 999 in exporter.index.blocks_of(w0),
                 what="the publisher relaying", every=0.1)
        for dp_rank, events in ZMQ_BATCHES:
            send(events, dp_rank)
        expected = {f"{peer.worker_id}{suffix}": m for suffix, m in ZMQ_EXPECTED[runtime].items()}
        wait_for(lambda: media(exporter) == expected, what="every tier")
    finally:
        peer.stop()
        pub.close()
    index = exporter.index
    assert index.parent(302) == 301
    if runtime == "1.6.1":  # each tier on its own: the GPU holds its 4 blocks whatever else the worker holds
        assert index.holds(w0, 303, "GPU") and not index.holds(w0, 303, "CPU") and index.holds(w0, 304, "EXTERNAL")
        assert index.parent(304) == 303
        assert index.resident_blocks(w0, "GPU") == 4
        assert sorted(index.blocks_of(worker_name(peer.worker_id, 1))) == [401]
    else:
        assert not index.holds(w0, 303) and index.holds(w0, 304, "GPU")
    assert exporter.counter("prefixscope_ingest_errors") == {}


def test_a_restarted_worker_is_cleared_and_followed_again(exporter: Exporter, nats_server: Nats,
                                                          tmp_path: Path) -> None:
    """Dynamo 1.6 with a fixed worker id: the new process publishes under a new publisher id and its
    event ids start again, so its old blocks go (the engine's cache went with the process) and the
    new ones are followed. It publishes one message and goes quiet: nothing refutes the restart, so
    it is confirmed once ``RESTART_CONFIRM_S`` has passed."""
    first = Peer("1.6.1", {"worker_id": 4242, "ranks": {"0": API_STEPS["0"]}}, nats_server, tmp_path)
    try:
        first.published()
        wait_for(lambda: media(exporter) == {"4242": {"GPU": 4}}, what="the first run")
    finally:
        first.stop()
    second = Peer("1.6.1", {"worker_id": 4242, "ranks": {"0": [{"stored": {"tokens": tokens(0, 1), "hashes": [501]}}]}},
                  nats_server, tmp_path)
    try:
        second.published()
        wait_for(lambda: media(exporter) == {"4242": {"GPU": 1}}, what="the second run")
    finally:
        second.stop()
    assert exporter.index.blocks_of("4242") == [501]
    assert exporter.counter("prefixscope_worker_restarts") == {("4242",): 1}
    assert set(exporter.counter("prefixscope_kv_event_sequence_gaps").values()) == {0}
