"""The cluster benchmark's record load: ``python -m bench._cluster_records``.

Posts request records (``prefixscope.request/v1``, NDJSON) to the exporter's
``POST /api/v1/records`` in batches every ``--interval`` seconds over one kept-alive connection,
at the rate set on stdin. Each record names a simulated worker and carries the block hashes
of one of that worker's chains behind its family's system prompt (``bench._cluster_fleet``),
so the exporter's index lookups ("available" reuse) find real prefixes: about half the chains
are resident at any time.

Control on stdin: ``rate <records/s>``, ``stats`` (one JSON line on stdout), ``quit``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from urllib.parse import urlsplit

from bench._cluster_fleet import BLOCK_SIZE, MODEL, Shape, chain_hashes, family_of, prefix_hashes, worker_name


class RecordMaker:
    """NDJSON lines for records on workers ``0..workers-1``; hash lists are encoded once per chain."""

    def __init__(self, workers: int, shape: Shape, seed: int = 0) -> None:
        self.workers = workers
        self.shape = shape
        self.rng = random.Random(seed)
        self.n = 0
        self._prefix = [",".join(map(str, prefix_hashes(f, shape))) for f in range(shape.families)]
        self._chains: dict[tuple[int, int], str] = {}
        self.prompt_tokens = (shape.prefix_blocks + shape.blocks_per_event) * BLOCK_SIZE

    def _hashes(self, w: int, chain: int) -> str:
        key = (w, chain)
        text = self._chains.get(key)
        if text is None:
            text = self._prefix[family_of(w, self.shape)] + "," + ",".join(map(str, chain_hashes(w, chain, self.shape)))
            if len(self._chains) < 200_000:
                self._chains[key] = text
        return text

    def line(self, ts: float) -> str:
        rng = self.rng
        w = rng.randrange(self.workers)
        chain = rng.randrange(self.shape.cycle_chains)
        self.n += 1
        cached = self.shape.prefix_blocks * BLOCK_SIZE * rng.randint(0, 3)
        return (f'{{"ts":{ts:.3f},"request_id":"bench-{self.n}","worker":"{worker_name(w)}",'
                f'"prompt_tokens":{self.prompt_tokens},"model":"{MODEL}","session_key":"s-{w}-{chain}",'
                f'"block_hashes":[{self._hashes(w, chain)}],"cached_tokens":{cached},'
                f'"ttft_s":{0.05 + rng.random() * 0.2:.4f},"prefill_s":{0.03 + rng.random() * 0.1:.4f},'
                f'"queue_s":{rng.random() * 0.02:.4f}}}')

    def body(self, count: int) -> bytes:
        ts = time.time()
        return "\n".join(self.line(ts) for _ in range(count)).encode()


class Poster:
    """One kept-alive connection; a failed post reconnects and counts an error."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path
        self.conn: http.client.HTTPConnection | None = None
        self.counts = {"posted": 0, "accepted": 0, "rejected": 0, "errors": 0, "post_s": 0.0}

    def post(self, body: bytes, records: int) -> None:
        started = time.monotonic()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            self.conn.request("POST", self.path, body, {"Content-Type": "application/x-ndjson"})
            resp = self.conn.getresponse()
            answer = json.loads(resp.read() or b"{}")
            data = answer.get("data") or {}
            self.counts["accepted"] += int(data.get("accepted", 0))
            self.counts["rejected"] += int(data.get("rejected", 0))
            if resp.status not in (200, 400):
                self.counts["errors"] += 1
        except (OSError, http.client.HTTPException, ValueError):
            self.counts["errors"] += 1
            if self.conn is not None:
                self.conn.close()
            self.conn = None
        self.counts["posted"] += records
        self.counts["post_s"] += time.monotonic() - started


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._cluster_records", description=__doc__)
    p.add_argument("--url", required=True, help="the exporter's /api/v1/records URL")
    p.add_argument("--workers", type=int, required=True, help="records name workers 0..N-1")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between batches")
    p.add_argument("--shape", default="{}", help="JSON of the fleet's Shape fields")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    maker = RecordMaker(args.workers, Shape(**json.loads(args.shape)), args.seed)
    poster = Poster(args.url)
    rate = [0.0]
    stop, stats_requested = threading.Event(), threading.Event()
    threading.Thread(target=_control, args=(rate, stop, stats_requested), daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    owed, last = 0.0, time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        owed += rate[0] * (now - last)
        last = now
        count = int(owed)
        if count:
            owed -= count
            poster.post(maker.body(count), count)
        if stats_requested.is_set():
            stats_requested.clear()
            print(json.dumps(poster.counts), flush=True)
        stop.wait(max(0.0, args.interval - (time.monotonic() - now)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
