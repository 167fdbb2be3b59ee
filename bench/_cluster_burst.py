"""Busy simulated workers for the cluster benchmark's high-rate mode: ``python -m bench._cluster_burst``.

``bench._cluster_fleet`` splices each batch when it sends it, which costs its Python more than a
busy worker's stream costs the exporter: a fleet on the same two cores cannot publish more than
about 100,000 block events/s that way. Here every message a worker will ever send is encoded
before the load starts, so a send is a timestamp, a join and a ``send_multipart``:

- each worker still has its own ZMQ PUB socket and ROUTER replay socket and its own sequence
  (three frames ``[topic, seq8, payload]``, payload ``[ts, events, dp_rank]`` with array-tagged
  events as vLLM ≤ 0.23 sends them — the bytes ``bench._cluster_fleet`` splices, token ids included);
- a worker's stream is the fleet's store/evict cycle (``bench._cluster_fleet``: the family's
  prefix and ``M`` resident chains out of ``C``) with ``events_per_batch`` events a message: event
  ``2t`` stores chain ``(M + t) mod C``, event ``2t + 1`` evicts chain ``t mod C``. Its messages
  repeat every ``2C / events_per_batch``, so they are built once (without the timestamp, which is
  stamped once per send round), and every worker stays at ``M`` chains: the index holds a bounded
  number of (worker, block) pairs however long the load runs;
- the replay buffer keeps only each message's timestamp (its bytes are the cycle's): a replay
  from any seq the buffer still holds is rebuilt exactly, and seq 0 (the warm cache) is always held;
- vLLM's /metrics pages are ``bench._cluster_fleet``'s (``Pages``, on a thread of its own).

Control on stdin as ``bench._cluster_fleet``: ``rate <events/s per worker>``, ``stats``, ``quit``;
the first stdout line is this process's part of the manifest.

``--hwm`` and ``--sndbuf`` bound what a worker holds for a subscriber that falls behind (vLLM's
``KVEventsConfig.hwm``; the kernel's send buffer): past them the PUB socket drops, and the
subscriber sees a gap that the replay heals. vLLM's default ``hwm`` of 100,000 batches keeps a
backlog in the worker for minutes before anything is dropped.
"""

from __future__ import annotations

import argparse
import json
import struct
import threading
import time
from array import array
from collections.abc import Sequence

import zmq

from bench._cluster_fleet import (
    END_SEQ,
    Pages,
    Shape,
    WorkerStream,
    _control,
    batch_payload,
    run_load,
    start_http,
    worker_name,
)

TS_AT = 2  # the payload's float64 timestamp follows the array header (0x93) and its type byte (0xcb)
_STAMP = struct.Struct(">d")


def stamp(ts: float) -> bytes:
    """The first bytes of every payload sent at ``ts``: ``[`` of three, a float64 and the time."""
    return b"\x93\xcb" + _STAMP.pack(ts)


def cycle_tails(stream: WorkerStream, events_per_batch: int) -> list[bytes]:
    """The worker's messages of one cycle, each without its first ``TS_AT + 8`` bytes (the stamp)."""
    c = stream.shape.cycle_chains
    if (2 * c) % events_per_batch:
        raise ValueError(f"events_per_batch must divide 2 × cycle_chains = {2 * c}")
    events = stream.next_events(c)  # a whole cycle: store, evict, store, evict, ...
    stream.step = 0
    return [batch_payload(0.0, events[i:i + events_per_batch])[TS_AT + 8:]
            for i in range(0, 2 * c, events_per_batch)]


class BusyWorker:
    """One worker's sockets, sequence and replay buffer (timestamps only); what ``Pages`` reads."""

    def __init__(self, ctx: zmq.Context, index: int, shape: Shape, events_per_batch: int, buffer: int,
                 hwm: int = 1000, sndbuf: int = 0) -> None:
        self.index = index
        self.name = worker_name(index)
        stream = WorkerStream(index, shape)
        self.warm = batch_payload(time.time(), stream.warm_events())  # seq 0, sent before anyone listens
        self.tails = cycle_tails(stream, events_per_batch)
        self.blocks_per_msg = events_per_batch * shape.blocks_per_event
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, hwm)  # vLLM's KVEventsConfig.hwm (its default: 100,000)
        if sndbuf > 0:
            self.pub.setsockopt(zmq.SNDBUF, sndbuf)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.seq = 0
        self.sent_ts = array("d", bytes(8 * buffer))  # seq s (≥ 1) at s % buffer
        self.accum = 0.0
        self.last = time.monotonic()
        self.events = self.batches = self.blocks = 0

    def payload(self, seq: int, head: bytes) -> bytes:
        return head + self.tails[(seq - 1) % len(self.tails)]

    def send_warm(self, shape: Shape) -> None:
        self.pub.send_multipart([b"", (0).to_bytes(8, "big"), self.warm])
        self.seq, self.events, self.batches, self.blocks = 1, 1 + shape.resident_chains, 1, shape.resident_blocks

    def send(self, count: int, head: bytes, ts: float, events_per_batch: int) -> None:
        send, ring, size, seq = self.pub.send_multipart, self.sent_ts, len(self.sent_ts), self.seq
        tails, period = self.tails, len(self.tails)
        for s in range(seq, seq + count):
            ring[s % size] = ts
            send([b"", s.to_bytes(8, "big"), head + tails[(s - 1) % period]])
        self.seq = seq + count
        self.events += count * events_per_batch
        self.batches += count
        self.blocks += count * self.blocks_per_msg

    def serve_replay(self) -> None:
        """Answer replay requests (vLLM ≥ 0.26's shape) for what the buffer holds, then the end marker."""
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, body = frames[0], [f for f in frames[1:] if f != b""]
            if len(body) != 1 or len(body[0]) != 8:
                continue
            start = int.from_bytes(body[0], "big")
            envelope = [ident, b"", b""]
            if start == 0:
                self.router.send_multipart([*envelope, (0).to_bytes(8, "big"), self.warm])
            size = len(self.sent_ts)
            for s in range(max(1, start, self.seq - size), self.seq):
                self.router.send_multipart([*envelope, s.to_bytes(8, "big"), self.payload(s, stamp(self.sent_ts[s % size]))])
            self.router.send_multipart([*envelope, END_SEQ, b""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._cluster_burst", description=__doc__)
    p.add_argument("--first", type=int, required=True, help="index of this process's first worker")
    p.add_argument("--count", type=int, required=True, help="workers in this process")
    p.add_argument("--events-per-batch", type=int, default=1, help="events a message carries (divides 2C)")
    p.add_argument("--buffer", type=int, default=1000, help="batches each replay buffer holds besides seq 0")
    p.add_argument("--hwm", type=int, default=1000, help="messages each PUB socket queues per subscriber")
    p.add_argument("--sndbuf", type=int, default=0, help="each PUB connection's kernel send buffer (0: the kernel's)")
    p.add_argument("--page-refresh", type=float, default=15.0, help="seconds a rendered /metrics page is reused")
    p.add_argument("--shape", default="{}", help="JSON of Shape fields")
    args = p.parse_args(argv)
    shape = Shape(**json.loads(args.shape))
    per_batch = args.events_per_batch
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, max(ctx.get(zmq.MAX_SOCKETS), 2 * args.count + 64))
    workers = [BusyWorker(ctx, i, shape, per_batch, args.buffer, args.hwm, args.sndbuf)
               for i in range(args.first, args.first + args.count)]
    rate = [0.0]
    port = start_http(Pages(workers, shape, args.page_refresh, rate))  # type: ignore[arg-type]
    for w in workers:  # seq 0 goes out before anyone listens (as a worker that started first): the replay has it
        w.send_warm(shape)
    manifest = [{"name": w.name, "url": f"http://127.0.0.1:{port}/w/{w.name}",
                 "kv_endpoint": w.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                 "replay_endpoint": w.router.getsockopt_string(zmq.LAST_ENDPOINT), "topic": ""} for w in workers]
    print(json.dumps({"workers": manifest}), flush=True)

    stop, stats_requested = threading.Event(), threading.Event()
    threading.Thread(target=_control, args=(rate, stop, stats_requested), daemon=True).start()
    def send_group(group: Sequence[BusyWorker], now: float) -> None:
        msgs_per_s = rate[0] / per_batch
        ts = time.time()
        head = stamp(ts)
        for w in group:
            w.accum += msgs_per_s * (now - w.last)
            w.last = now
            count = int(w.accum)
            if count:
                w.accum -= count
                w.send(count, head, ts, per_batch)

    run_load(workers, rate, stop, stats_requested, send_group)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
