"""The KV subscriber alone against 1,000 busy workers: ``python -m bench.cluster_subscriber``.

``make bench-cluster --high-rate`` runs the whole exporter process, whose figures on a shared
machine mix its own work with waiting for a core. This runs only what the KV streams cost: the
high-rate fleet (``bench._cluster_burst``: 64-block events, one a message, encoded ahead) in load
processes, and in this process the real ``KvEventSubscriber`` feeding a real ``ClusterState`` (no
scrapes, records or renders). Its yardstick is the subscriber thread's own CPU time per batch
applied, so a busy machine slows it but does not change it much.

Three runs at the same rate, one after the other: the subscriber as it is (its socket rounds
compiled, ``exporter.sources._zmq_rounds``, and paced), with pyzmq's poller and ``recv_multipart``
instead (the reference rounds), and compiled but not paced (the next round as soon as the last
ends), each reporting block events applied per second of the subscriber thread's CPU (the ZMQ I/O
thread's is not in it).

``--workers`` (default 1,000), ``--rate`` (events/s per worker, default 20), ``--seconds`` (default 15).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

import zmq

import exporter.sources.kv_zmq as kv_zmq
from bench.cluster import CLK_TCK, HIGH_RATE_SHAPE, REPO, _env
from exporter.bootstrap import bootstrap
from exporter.sources.zmq_rounds import PyzmqRounds, SocketRounds

PER_PROCESS = 500
WARM_S = 3.0  # the load runs this long before the measured window


def _fleet(n: int) -> tuple[list[subprocess.Popen[str]], dict[str, kv_zmq.KvEndpoint]]:
    procs, endpoints = [], {}
    for first in range(0, n, PER_PROCESS):
        p = subprocess.Popen([sys.executable, "-m", "bench._cluster_burst", "--first", str(first), "--count",
                              str(min(PER_PROCESS, n - first)), "--shape", json.dumps(asdict(HIGH_RATE_SHAPE))],
                             cwd=REPO, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert p.stdout is not None
        for w in json.loads(p.stdout.readline())["workers"]:
            endpoints[w["name"]] = kv_zmq.KvEndpoint(w["kv_endpoint"], w["replay_endpoint"])
        procs.append(p)
    return procs, endpoints


def _tell(procs: list[subprocess.Popen[str]], line: str) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()


class CountedRounds:
    """The subscriber's socket rounds, telling ``on_poll`` what each poll answered."""

    def __init__(self, inner: SocketRounds, on_poll: Callable[[list[int]], None]) -> None:
        self.inner, self.on_poll = inner, on_poll

    def follow(self, sockets: Iterable[zmq.Socket]) -> None:
        self.inner.follow(sockets)

    def poll(self, timeout_ms: int) -> list[int]:
        ready = self.inner.poll(timeout_ms)
        self.on_poll(ready)
        return ready

    def drain(self, i: int, limit: int) -> tuple[list[list[bytes]], bool]:
        return self.inner.drain(i, limit)

    def again(self, i: int) -> None:
        self.inner.again(i)


def run(n: int, rate: float, seconds: float, paced: bool, compiled: bool = True) -> dict[str, Any]:
    """One subscriber over a fresh fleet; the subscriber's thread CPU per applied batch in the window."""
    procs, endpoints = _fleet(n)
    parts = bootstrap()  # the composition root's state, as the exporter builds it
    health = parts.health
    sub = kv_zmq.KvEventSubscriber(endpoints, parts.state, health)
    polls = [0]

    def count(_ready: list[int]) -> None:
        polls[0] += 1

    sub._rounds = CountedRounds(sub._rounds if compiled else PyzmqRounds(), count)
    if not paced:
        sub._set_round_gap = lambda: None  # type: ignore[method-assign]
    def batches() -> float:
        return sum(health.counters.get("prefixscope_kv_event_batches", {}).values())

    try:
        sub.start()
        assert sub.wait_started(120)
        _tell(procs, f"rate {rate:g}")
        time.sleep(WARM_S)
        tid = sub._thread.native_id if sub._thread is not None else None
        assert tid is not None
        c0, b0, p0, t0 = _thread_cpu(tid), batches(), polls[0], time.monotonic()
        time.sleep(seconds)
        c1, b1, p1, t1 = _thread_cpu(tid), batches(), polls[0], time.monotonic()
        lag = max(health.gauges.get(kv_zmq.LAG, {}).values(), default=0.0)
    finally:
        _tell(procs, "quit")
        sub.close()
        for p in procs:
            p.wait(10)
    applied = b1 - b0
    blocks = applied * HIGH_RATE_SHAPE.blocks_per_event
    return {"paced": paced, "rounds": "compiled" if compiled else "reference", "round_gap_s": sub.round_gap_s, "batches_per_s": applied / (t1 - t0),
            "block_events_per_s": blocks / (t1 - t0), "thread_cpu": (c1 - c0) / (t1 - t0),
            "polls_per_s": (p1 - p0) / (t1 - t0), "cpu_us_per_batch": (c1 - c0) / applied * 1e6 if applied else None,
            "block_events_per_cpu_s": blocks / (c1 - c0) if c1 > c0 else None, "lag_max_s": lag}


def _thread_cpu(tid: int) -> float:
    """One thread's CPU seconds (utime + stime) so far."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_subscriber", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="events/s per worker (64 blocks each)")
    p.add_argument("--seconds", type=float, default=15.0)
    args = p.parse_args(argv)
    rows = [run(args.workers, args.rate, args.seconds, paced, compiled)
            for paced, compiled in ((True, True), (True, False), (False, True))]
    for r in rows:
        print(f"{r['rounds']} rounds, {'paced' if r['paced'] else 'unpaced'} (gap {r['round_gap_s'] * 1000:.1f} ms): "
              f"{r['block_events_per_s']:,.0f} block events/s applied, subscriber thread {r['thread_cpu']:.2f} "
              f"of a core, {r['polls_per_s']:.0f} polls/s, {r['cpu_us_per_batch'] or 0:.1f} µs a batch: "
              f"{r['block_events_per_cpu_s'] or 0:,.0f} block events per second of its CPU; lag {r['lag_max_s']:.2f}s")
    compiled, reference, unpaced = (r["cpu_us_per_batch"] for r in rows)
    if compiled and reference and unpaced:
        print(f"CPU a batch, compiled / reference rounds: {compiled / reference:.2f}; "
              f"paced / unpaced (compiled): {compiled / unpaced:.2f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
