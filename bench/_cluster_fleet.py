"""Cheap simulated workers for the cluster benchmark: ``python -m bench._cluster_fleet``.

One process serves many workers, so the benchmark measures the exporter rather than the load:

- each worker has its own ZMQ PUB socket and ROUTER replay socket (vLLM's wire format: three
  frames ``[topic, seq8, payload]``, payload ``[ts, events, dp_rank]`` with array-tagged
  events, as vLLM ≤ 0.23 sends them); payloads are spliced from msgpack pieces encoded once at
  start, and only the timestamp is packed per batch;
- one asyncio HTTP server serves every worker's vLLM /metrics page at ``/w/<name>/metrics``
  (rendered by ``fleet.metrics_text`` and cached for ``--page-refresh`` seconds).

The cache each worker reports follows a fixed cycle that keeps the view consistent: a shared
system-prompt prefix of ``prefix_blocks`` (one of ``families``, stored once and never evicted),
then ``resident_chains`` chains of ``blocks_per_event`` blocks. Step ``t`` stores chain
``(M + t) mod C`` and evicts chain ``t mod C`` (M resident, C in the cycle), so every worker
stays at the same resident count and a chain comes back ``C - M`` steps after its eviction
(what the exporter sees as thrash). Batch seq 0 is the warm cache (prefix and the first M
chains): the exporter learns it from the replay it asks for at start.

Control on stdin, one command a line: ``rate <events/s per worker>``, ``stats`` (answered with
one JSON line on stdout), ``quit``. The first stdout line is the manifest part of this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol, TypeVar

import msgpack
import zmq

BLOCK_SIZE = 16
MEDIUM = "GPU"
MODEL = "bench-model"  # every worker serves it (its /metrics, the records, the topology)
SUBTICKS = 10  # workers are served in this many staggered groups per tick (no synchronised bursts)
SUBTICK_S = 0.01  # so a worker sends at most one batch per SUBTICKS * SUBTICK_S = 0.1 s
END_SEQ = b"\xff" * 8


@dataclass(frozen=True)
class Shape:
    """What every simulated worker's cache looks like (the same for all, so the load is even)."""

    blocks_per_event: int = 8
    prefix_blocks: int = 4
    families: int = 4
    resident_chains: int = 96  # M
    cycle_chains: int = 192  # C
    capacity_blocks: int = 2048  # num_gpu_blocks on the worker's /metrics

    @property
    def resident_blocks(self) -> int:
        return self.prefix_blocks + self.resident_chains * self.blocks_per_event


def worker_name(index: int) -> str:
    return f"w{index:04d}"


def family_of(index: int, shape: Shape) -> int:
    return index % shape.families


def _hashes(key: bytes, n: int) -> list[int]:
    """``n`` unsigned 64-bit hashes (a stand-in for vLLM's chained block hashes): one digest for up
    to eight, then one digest per further eight (a digest holds at most 64 bytes)."""
    if n <= 8:
        digest = blake2b(key, digest_size=8 * n).digest()
    else:
        digest = b"".join(blake2b(key + b"#%d" % part, digest_size=64).digest() for part in range((n + 7) // 8))
    return [int.from_bytes(digest[i:i + 8], "big") for i in range(0, 8 * n, 8)]


def prefix_hashes(family: int, shape: Shape) -> list[int]:
    return _hashes(b"prefix/%d" % family, shape.prefix_blocks)


def chain_hashes(worker_index: int, chain: int, shape: Shape) -> list[int]:
    """Block hashes of chain ``chain`` (0 ≤ chain < C) on worker ``worker_index``."""
    return _hashes(b"chain/%d/%d" % (worker_index, chain), shape.blocks_per_event)


# ---- msgpack pieces (byte-identical to fleet.kv_publisher.encode_batch, see the tests) -----------
def array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_STORED = msgpack.packb("BlockStored")
_REMOVED = msgpack.packb("BlockRemoved")
_NIL = msgpack.packb(None)
_ZERO = msgpack.packb(0)
_MEDIUM = msgpack.packb(MEDIUM)
_FULL = msgpack.packb("full_attention")
_BLOCK_SIZE = msgpack.packb(BLOCK_SIZE)


def _tokens(n_blocks: int, seed: int) -> bytes:
    """Token ids for ``n_blocks`` blocks: vLLM sends them; the exporter decodes them (a real cost)."""
    return msgpack.packb([1000 + (seed * 7919 + i * 104729) % 60000 for i in range(n_blocks * BLOCK_SIZE)])


def stored_event(hashes_blob: bytes, n_blocks: int, parent: int | None, tokens_blob: bytes) -> bytes:
    """A BlockStored event in vLLM 0.23's array order: block_hashes, parent, token_ids, block_size,
    lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window."""
    return b"".join((array_header(12), _STORED, hashes_blob, msgpack.packb(parent), tokens_blob, _BLOCK_SIZE,
                     _NIL, _MEDIUM, _NIL, msgpack.packb([None] * n_blocks), _ZERO, _FULL, _NIL))


def removed_event(hashes_blob: bytes) -> bytes:
    return b"".join((array_header(4), _REMOVED, hashes_blob, _MEDIUM, _ZERO))


def batch_payload(ts: float, events: list[bytes], dp_rank: int = 0) -> bytes:
    """``[ts, events, dp_rank]`` from already-encoded events: only the timestamp is packed here."""
    return b"".join((b"\x93", msgpack.packb(float(ts)), array_header(len(events)), *events, msgpack.packb(dp_rank)))


class WorkerStream:
    """One worker's events: its chains' encoded events and its place in the store/evict cycle."""

    def __init__(self, index: int, shape: Shape) -> None:
        self.index = index
        self.shape = shape
        b, fam = shape.blocks_per_event, family_of(index, shape)
        tokens = _tokens(b, index)
        prefix = prefix_hashes(fam, shape)
        blobs = [msgpack.packb(chain_hashes(index, j, shape)) for j in range(shape.cycle_chains)]
        self.stored = [stored_event(h, b, prefix[-1], tokens) for h in blobs]
        self.removed = [removed_event(h) for h in blobs]
        self.prefix_event = stored_event(msgpack.packb(prefix), shape.prefix_blocks, None,
                                         _tokens(shape.prefix_blocks, fam))
        self.step = 0

    def warm_events(self) -> list[bytes]:
        """Seq 0: the system prompt's prefix and the first M chains."""
        return [self.prefix_event, *self.stored[:self.shape.resident_chains]]

    def next_events(self, steps: int) -> list[bytes]:
        """The events of the next ``steps`` steps (two events each: a chain stored, one evicted)."""
        m, c = self.shape.resident_chains, self.shape.cycle_chains
        out: list[bytes] = []
        for _ in range(steps):
            t = self.step
            out.append(self.stored[(m + t) % c])
            out.append(self.removed[t % c])
            self.step += 1
        return out


class SimWorker:
    """A worker's sockets, sequence, replay buffer and the counters its /metrics page shows."""

    def __init__(self, ctx: zmq.Context, index: int, shape: Shape, buffer: int) -> None:
        self.index = index
        self.name = worker_name(index)
        self.stream = WorkerStream(index, shape)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.seq = 0
        self.warm: tuple[int, bytes] | None = None
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.accum = 0.0
        self.events = 0
        self.batches = 0
        self.blocks = 0

    def endpoint(self, sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, events: list[bytes], blocks: int) -> None:
        payload = batch_payload(time.time(), events)
        seq = self.seq
        self.seq += 1
        if seq == 0:
            self.warm = (0, payload)  # kept for every later replay from 0 (a rebuild)
        else:
            self.buffer.append((seq, payload))
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=False)
        self.events += len(events)
        self.batches += 1
        self.blocks += blocks

    def serve_replay(self) -> None:
        """Answer replay requests (vLLM ≥ 0.26's shape) from the buffer, then the end marker."""
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, body = frames[0], [f for f in frames[1:] if f != b""]
            if len(body) != 1 or len(body[0]) != 8:
                continue
            start = int.from_bytes(body[0], "big")
            envelope = [ident, b""]
            held = ([self.warm] if self.warm is not None else []) + list(self.buffer)
            for seq, payload in held:
                if seq >= start:
                    self.router.send_multipart([*envelope, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([*envelope, b"", END_SEQ, b""])


class Pages:
    """Every worker's vLLM /metrics page, re-rendered at most every ``refresh`` seconds."""

    def __init__(self, workers: list[SimWorker], shape: Shape, refresh: float, rate: list[float]) -> None:
        from fleet.engine import EngineCounters, WorkerSpec

        self.workers = {w.name: w for w in workers}
        self.specs = {w.name: WorkerSpec(w.name, model=MODEL, num_gpu_blocks=shape.capacity_blocks,
                                         block_size=BLOCK_SIZE) for w in workers}
        self.created = time.time()
        self.counters = EngineCounters
        self.shape = shape
        self.refresh = refresh
        self.rate = rate  # shared one-element list: the current event rate
        self.cache: dict[str, tuple[float, bytes]] = {}

    def page(self, name: str) -> bytes | None:
        w = self.workers.get(name)
        if w is None:
            return None
        now = time.monotonic()
        cached = self.cache.get(name)
        if cached is not None and now - cached[0] < self.refresh:
            return cached[1]
        from fleet.engine import EngineSnapshot
        from fleet.metrics_text import render_snapshot

        tokens = w.blocks // 2 * BLOCK_SIZE  # stored blocks were computed: queried, about half hit
        counters = self.counters(created=self.created, prefix_queries=2 * tokens, prefix_hits=tokens,
                                 prompt_tokens=2 * tokens, generation_tokens=tokens // 4,
                                 requests_success={"stop": w.batches})
        busy = self.rate[0] > 0
        snap = EngineSnapshot(at=time.time(), running=4 if busy else 0, waiting=0,
                              kv_usage=self.shape.resident_blocks / self.shape.capacity_blocks,
                              resident_blocks=self.shape.resident_blocks, counters=counters)
        body = render_snapshot(self.specs[name], snap, "vllm")
        self.cache[name] = (now, body)
        return body


async def _serve_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pages: Pages) -> None:
    """One GET, answered and closed (the exporter's scraper sends ``Connection: close``)."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        parts = head.split(b" ", 2)
        path = parts[1].decode("latin-1") if len(parts) > 1 else ""
        body = None
        if path.startswith("/w/") and path.endswith("/metrics"):
            body = pages.page(path[3:-len("/metrics")])
        if body is None:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


def start_http(pages: Pages) -> int:
    """Serve the pages on a thread of their own; returns the port."""
    ready: list[int] = []
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()

        async def main() -> None:
            server = await asyncio.start_server(lambda r, w: _serve_http(r, w, pages), "127.0.0.1", 0, backlog=1024)
            ready.append(server.sockets[0].getsockname()[1])
            started.set()
            async with server:
                await server.serve_forever()

        loop.run_until_complete(main())

    threading.Thread(target=run, name="bench-fleet-http", daemon=True).start()
    started.wait(10)
    return ready[0]


def _control(rate: list[float], stop: threading.Event, stats_requested: threading.Event) -> None:
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "rate":
            rate[0] = float(arg)
        elif cmd == "stats":
            stats_requested.set()
        elif cmd == "quit":
            break
    stop.set()


W = TypeVar("W", bound="LoadWorker")


class LoadWorker(Protocol):
    """What the load loop needs of a simulated worker: its sockets, its replay and its counts."""
    pub: zmq.Socket
    router: zmq.Socket
    events: int
    batches: int
    blocks: int

    def serve_replay(self) -> None: ...


def run_load(workers: Sequence[W], rate: list[float], stop: threading.Event, stats_requested: threading.Event,
             send_group: Callable[[Sequence[W], float], None]) -> None:
    """Until ``stop``: answer replay requests, and every ``SUBTICK_S`` call ``send_group`` for the
    next of ``SUBTICKS`` staggered groups of workers (no synchronised bursts) with the time now; on
    a stats request print the counts and the longest a group waited between two visits (the load's
    own delay). Behind schedule it does not catch up in a burst. Closes the workers' sockets."""
    poller = zmq.Poller()
    routers = {w.router: w for w in workers}
    for sock in routers:
        poller.register(sock, zmq.POLLIN)
    groups = [workers[i::SUBTICKS] for i in range(SUBTICKS)]
    sub, next_tick = 0, time.monotonic()
    visited = [next_tick] * SUBTICKS
    stall = 0.0
    while not stop.is_set():
        for sock, _ in poller.poll(0):
            routers[sock].serve_replay()
        now = time.monotonic()
        stall = max(stall, now - visited[sub])
        visited[sub] = now
        send_group(groups[sub], now)
        sub = (sub + 1) % SUBTICKS
        if stats_requested.is_set():
            stats_requested.clear()
            print(json.dumps({"events": sum(w.events for w in workers), "batches": sum(w.batches for w in workers),
                              "blocks": sum(w.blocks for w in workers), "stall_s": stall}), flush=True)
            stall = 0.0
        next_tick += SUBTICK_S
        delay = next_tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_tick = time.monotonic()
    for w in workers:
        w.pub.close(0)
        w.router.close(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._cluster_fleet", description=__doc__)
    p.add_argument("--first", type=int, required=True, help="index of this process's first worker")
    p.add_argument("--count", type=int, required=True, help="workers in this process")
    p.add_argument("--buffer", type=int, default=200, help="batches each replay buffer holds besides seq 0")
    p.add_argument("--page-refresh", type=float, default=15.0, help="seconds a rendered /metrics page is reused")
    p.add_argument("--shape", default="{}", help="JSON of Shape fields")
    args = p.parse_args(argv)
    shape = Shape(**json.loads(args.shape))
    ctx = zmq.Context(io_threads=1)
    workers = [SimWorker(ctx, i, shape, args.buffer) for i in range(args.first, args.first + args.count)]
    rate = [0.0]
    port = start_http(Pages(workers, shape, args.page_refresh, rate))
    for w in workers:  # seq 0 goes out before anyone listens (as a worker that started first): the replay has it
        w.send(w.stream.warm_events(), shape.resident_blocks)
    manifest = [{"name": w.name, "url": f"http://127.0.0.1:{port}/w/{w.name}",
                 "kv_endpoint": w.endpoint(w.pub), "replay_endpoint": w.endpoint(w.router), "topic": ""}
                for w in workers]
    print(json.dumps({"workers": manifest}), flush=True)

    stop, stats_requested = threading.Event(), threading.Event()
    threading.Thread(target=_control, args=(rate, stop, stats_requested), daemon=True).start()
    last = {w.name: time.monotonic() for w in workers}
    blocks_per_step = 2 * shape.blocks_per_event

    def send_group(group: Sequence[SimWorker], now: float) -> None:
        steps_per_s = rate[0] / 2  # two events a step
        for w in group:
            w.accum += steps_per_s * (now - last[w.name])
            last[w.name] = now
            steps = int(w.accum)
            if steps:
                w.accum -= steps
                w.send(w.stream.next_events(steps), steps * blocks_per_step)

    run_load(workers, rate, stop, stats_requested, send_group)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
